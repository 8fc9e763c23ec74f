"""qoqserve: QoQ W4A8KV4 quantization and a serving engine built around it."""
from qoqserve.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # lazy: `import qoqserve.<submodule>` must stay cheap, and every layer below the
    # API imports this package first (the one arrow that points up, on demand only)
    if name == "LLM":
        # lazy: as above
        from qoqserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        # lazy: as above
        from qoqserve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
