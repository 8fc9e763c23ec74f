"""qoqserve: QoQ W4A8KV4 quantization and a serving engine built around it."""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # Lazy, so that `import qoqserve.<submodule>` stays cheap (no model loading stack).
    if name == "LLM":
        from qoqserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from qoqserve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
