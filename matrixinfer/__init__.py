"""matrixinfer: CloudMatrix-Infer for DeepSeek-style MoE models in Python: a serving instance,
the Elastic Memory Service, an OpenAI-compatible token service and a CloudMatrix384 simulator
(the disaggregated prefill/decode stack of the paper is not built yet; see README)."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import matrixinfer.sim` does not pay for torch.
    if name in ("LLM", "SamplingParams"):
        from matrixinfer import frontend

        return getattr(frontend, name)
    raise AttributeError(name)
