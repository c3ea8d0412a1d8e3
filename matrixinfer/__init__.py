"""matrixinfer: CloudMatrix-Infer for DeepSeek-style MoE models in Python: serving instances
disaggregated into prefill, decode and caching roles over the Elastic Memory Service, expert
parallelism, INT8, MTP, an OpenAI-compatible token service and a CloudMatrix384 simulator
(README; docs/architecture.md)."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import matrixinfer.sim` does not pay for torch.
    if name in ("LLM", "SamplingParams"):
        from matrixinfer import frontend

        return getattr(frontend, name)
    raise AttributeError(name)
