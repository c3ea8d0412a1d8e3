"""matrixinfer: CloudMatrix-Infer (serving for DeepSeek-style MoE models) in Python."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import matrixinfer.sim` does not pay for torch.
    if name in ("LLM", "SamplingParams"):
        from matrixinfer import frontend

        return getattr(frontend, name)
    raise AttributeError(name)
