"""Engine configuration: one dataclass per concern, gathered in EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        # CPUs here have fast fp32 and bf16 but slow fp16; GPUs want half precision.
        return torch.float32 if device == "cpu" else torch.float16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class CacheConfig:
    block_size: int = 16            # tokens per KV page
    # KV budget in GiB. None: on CUDA kv_cache_fraction of free device memory
    # (after weights); on CPU min(kv_cache_fraction of free RAM, 2 GiB), since
    # zero-filling a huge pool costs seconds of start-up and CPU batches are small.
    kv_cache_gb: float | None = None
    kv_cache_fraction: float = 0.3
    num_blocks: int | None = None   # overrides the budget (tests use tiny pools)
    # "auto": int4 for a QoQ checkpoint calibrated with KV4, else the model dtype;
    # or "int4", "float16", "bfloat16", "float32"
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # prefill attends to K/V as stored (e.g. KV4) instead of as computed; None:
    # whenever the page format is lossier than the activations (see KVCacheLayout)
    quantized_prefill: bool | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # defaults to the model's context window


@dataclass
class EngineConfig:
    model: str | None = None        # path, or None for the embedded default model
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    w4a8_backend: str = "auto"      # QoQ checkpoints: auto | torch-int8 | torch-int8-percall | sim | triton
    # "auto": the Triton kernels on CUDA; on CPU ("cpu") the C KV4 decode kernel
    # where a compiler builds it, else torch; "torch": torch only. "triton" on
    # CPU only runs in Triton's interpreter (TRITON_INTERPRET=1), for the tests
    kernels: str = "auto"
    quantization: str | None = None  # full-precision checkpoints: None or "w8a8" (at load)
    # torch.compile the decode attention (fuses page gather + KV4 dequant); the
    # first step pays the compile (~30 s on 2 cores, cached on disk afterwards)
    compile: bool = False
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)
