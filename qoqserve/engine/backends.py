"""One home for backend selection: device, the kernels that build here and the
user's flags -> the quantization scheme, the linear method, the KV page
format and the attention kernels over it. The runner, `bench memory` and the
tests all ask here; nothing else decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from qoqserve.config import LM_HEAD_DTYPES, CacheConfig, EngineConfig, parse_dtype
from qoqserve.kernels.cpu import w4a8_gemm
from qoqserve.kernels.triton import interpreting, triton_available
from qoqserve.layers.attention_backends import (
    AttentionBackend,
    CpuAttention,
    TritonAttention,
)
from qoqserve.layers.kv_cache import (
    DenseKVCacheLayout,
    Int4KVCacheLayout,
    Int8KVCacheLayout,
    KVCacheLayout,
)
from qoqserve.layers.linear import LinearMethod
from qoqserve.layers.logits import CpuLogitsHead, Int8LogitsHead, LogitsHead
from qoqserve.layers.quantization import (
    KernelChoice,
    QuantizationConfig,
    resolve_quantization,
)
from qoqserve.layers.quantization.int8_gemm import fused_int8_available
from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
from qoqserve.models.arch import ModelArchConfig


@dataclass
class Backends:
    quant: QuantizationConfig      # the scheme that runs (checkpoint's, or applied at load)
    choice: KernelChoice
    linear_method: Callable[[str], LinearMethod]  # a linear's method by its name
    attention: AttentionBackend    # page format (attention.layout) + kernels
    logits_head: LogitsHead
    token_ops: TorchTokenOps


def resolve_kernels(config: EngineConfig) -> str:
    """Which kernel family runs: 'triton' (CUDA), 'cpu' (our C kernels where
    they build, else torch) or 'torch' (torch only)."""
    kind = config.kernels
    if kind == "auto":
        if config.device.startswith("cuda"):
            return "triton" if triton_available() else "torch"
        return "cpu"
    if kind not in ("torch", "triton", "cpu"):
        raise ValueError(f"unknown kernels {kind!r}; choose auto, torch, cpu or triton")
    if kind == "triton":
        if not triton_available():
            raise ValueError("kernels='triton' needs the triton package")
        if not config.device.startswith("cuda") and not interpreting():
            raise ValueError("Triton kernels on CPU run only in the interpreter (TRITON_INTERPRET=1)")
    return kind


def packed_w4a8_available() -> bool:
    """The packed W4A8 kernel builds here and runs a vector path: AVX2, AVX-512
    VNNI or AMX (its scalar fallback is for checking)."""
    return w4a8_gemm.available() and w4a8_gemm.isa() != "scalar"


def kernel_choice(config: EngineConfig) -> KernelChoice:
    kernels = resolve_kernels(config)
    c_on_cpu = kernels == "cpu" and config.device == "cpu"
    fused = c_on_cpu and fused_int8_available()
    w4a8 = config.w4a8_backend
    if w4a8 == "auto":
        w4a8 = "triton" if kernels == "triton" else "packed" if c_on_cpu and packed_w4a8_available() \
            else "torch-int8"
    return KernelChoice(kernels=kernels, w4a8=w4a8, fused_int8=fused)


def kv_layout(arch: ModelArchConfig, cache: CacheConfig, model_dtype: torch.dtype, device: str,
              kv_format: str | None) -> KVCacheLayout:
    """The page format: --kv-cache-dtype, or with 'auto' what the checkpoint was
    calibrated for (kv_format), else the activations' dtype."""
    kind = cache.kv_cache_dtype
    if kind == "auto":
        kind = kv_format or "model"
    if kind == "int4":
        return Int4KVCacheLayout(arch.num_kv_heads, arch.head_dim, cache.block_size)
    if kind == "int8":
        return Int8KVCacheLayout(arch.num_kv_heads, arch.head_dim, cache.block_size)
    dtype = model_dtype if kind == "model" else parse_dtype(kind, device)
    return DenseKVCacheLayout(arch.num_kv_heads, arch.head_dim, cache.block_size, dtype)


def attention_backend(layout: KVCacheLayout, choice: KernelChoice, cache: CacheConfig,
                      model_dtype: torch.dtype, device: str, compile: bool) -> AttentionBackend:
    # prefill sees stored K/V whenever the pages hold less than the activations do
    lossy = not isinstance(layout, DenseKVCacheLayout) or layout.dtype != model_dtype
    prefill = lossy if cache.quantized_prefill is None else cache.quantized_prefill
    if choice.kernels == "triton" and TritonAttention.supports(layout):
        return TritonAttention(layout, prefill)
    if choice.kernels == "cpu" and device == "cpu" and CpuAttention.supports(layout):
        return CpuAttention(layout, prefill)
    return AttentionBackend(layout, prefill, compiled=compile)


def select_backends(config: EngineConfig, arch: ModelArchConfig,
                    checkpoint_quant: QuantizationConfig) -> Backends:
    quant = resolve_quantization(checkpoint_quant, config.quantization)
    choice = kernel_choice(config)
    layout = kv_layout(arch, config.cache, config.torch_dtype, config.device, quant.get_kv_format())
    attention = attention_backend(layout, choice, config.cache, config.torch_dtype, config.device,
                                  config.compile)
    on_cpu = choice.kernels == "cpu" and config.device == "cpu"
    dtype = config.torch_dtype
    return Backends(quant, choice, quant.linear_methods(choice), attention,
                    logits_head(config.lm_head_dtype, choice, on_cpu, dtype, quant),
                    CpuTokenOps() if on_cpu and CpuTokenOps.supports(dtype) else TorchTokenOps())


def logits_head(lm_head_dtype: str, choice: KernelChoice, on_cpu: bool, dtype: torch.dtype,
                quant: QuantizationConfig) -> LogitsHead:
    if lm_head_dtype not in LM_HEAD_DTYPES:
        raise ValueError(f"lm_head_dtype {lm_head_dtype!r}: choose one of {', '.join(LM_HEAD_DTYPES)}")
    if lm_head_dtype == "int8" or (lm_head_dtype == "auto" and on_cpu and quant.int8_lm_head):
        return Int8LogitsHead(fused=choice.fused_int8, cpu_ops=choice.cpu_ops)
    return CpuLogitsHead() if on_cpu and CpuLogitsHead.supports(dtype) else LogitsHead()
