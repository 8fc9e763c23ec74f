"""Every kernel launch the engine can make, found by calling the real wrappers
on CPU tensors of the engine's shapes while aot.recording() stands in for
the launches (see aot.py). Tensors are torch.empty: never touched, so even
70B-sized ones cost no memory.
"""
from __future__ import annotations

import torch

from qoqserve.kernels.triton import act_quant, kv4_attention, paged_decode, w4a8_gemm
from qoqserve.kernels.triton.aot import Launch, Result, compile_launch, recording, unique

# name -> (hidden, intermediate, heads, kv heads, head_dim): the architectures
# of qoqserve.model_loader.synthetic.ARCHS (tests/test_triton_aot.py keeps
# the two in step; kernels do not import the model loader)
ARCHS = {
    "llama-3-8b": (4096, 14336, 32, 8, 128),
    "llama-3-70b": (8192, 28672, 64, 8, 128),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64),
    "llama-2-7b": (4096, 11008, 32, 32, 128),
    "llama-2-13b": (5120, 13824, 40, 40, 128),
    "mistral-7b": (4096, 14336, 32, 8, 128),
    "smollm2-135m": (576, 1536, 9, 3, 64),
    "qwen3-8b": (4096, 12288, 32, 8, 128),
    "tiny": (128, 256, 4, 2, 32),
    "tiny-qwen3": (128, 256, 4, 2, 64),
    "tiny-phi3": (128, 256, 4, 2, 32),
    "gemma-2-2b": (2304, 9216, 8, 4, 256),
    "tiny-gemma2": (128, 256, 4, 2, 64),
    "gemma-3-1b": (1152, 6912, 4, 1, 256),
    "tiny-gemma3": (128, 256, 4, 2, 64),
}
QUICK_ARCHS = ("llama-3-8b", "smollm2-135m")
# the architectures whose attention scores are soft-capped (Gemma 2): their
# decode kernel is a variant of its own
SOFTCAPS = {"gemma-2-2b": 50.0, "tiny-gemma2": 50.0}
GROUPS = (0, 32, 64, 128, 256)
M_PER_BUCKET = (1, 32, 64, 256, 4096)   # one M in each tile bucket of w4a8_gemm.M_BUCKETS
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _e(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


def linears(hidden, inter, heads, kv, hd):
    return {"qkv": ((heads + 2 * kv) * hd, hidden), "o": (hidden, heads * hd),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def _gemm(m, n, k, group, dtype, bias):
    per_group = (n, k // group) if group else (n,)
    w4a8_gemm.w4a8_gemm(_e(m, k, dtype=torch.int8), _e(m, dtype=torch.float32),
                        _e(n, k // 2, dtype=torch.uint8), _e(n), _e(*per_group, dtype=torch.uint8),
                        _e(*per_group, dtype=torch.uint8) if group else None, group,
                        _e(m, dtype=torch.float32), _e(n, dtype=dtype) if bias else None, out_dtype=dtype)


def _gemm_launches(archs, groups, dtypes, biases, label):
    for name in archs:
        for lin, (n, k) in linears(*ARCHS[name]).items():
            for group in groups:
                if group and k % group:
                    continue
                for m in M_PER_BUCKET:
                    for dtype in dtypes:
                        for bias in biases:
                            label[0] = f"{name} {lin} g{group} M={m} {str(dtype)[6:]}{' bias' if bias else ''}"
                            _gemm(m, n, k, group, dtype, bias)


def _act_launches(archs, dtypes, label):
    for name in archs:
        hidden, inter, heads, _, hd = ARCHS[name]
        for dtype in dtypes:
            tag = f"{name} {str(dtype)[6:]}"
            label[0] = f"{tag} rmsnorm K={hidden}"
            act_quant.rmsnorm_quant(_e(1, hidden, dtype=dtype), _e(hidden, dtype=dtype), 1e-5)
            label[0] = f"{tag} silu*mul K={inter}"
            act_quant.silu_mul_quant(_e(1, 2 * inter, dtype=dtype))
            label[0] = f"{tag} quant K={heads * hd}"
            act_quant.quant_int8(_e(1, heads * hd, dtype=dtype))


def _kv_launches(archs, dtypes, page_sizes, batches, label, ctx=4096):
    for name in archs:
        _, _, heads, kv, hd = ARCHS[name]
        for bs in page_sizes:
            nb = ctx // bs
            cache = _e(nb * 64, bs, 2, kv, hd // 2 + 4, dtype=torch.uint8)
            for dtype in dtypes:
                tag = f"{name} bs={bs} {str(dtype)[6:]}"
                label[0] = f"{tag} kv4 write"
                qkv = _e(8, (heads + 2 * kv) * hd, dtype=dtype)
                k = qkv[:, heads * hd:(heads + kv) * hd].view(8, kv, hd)
                v = qkv[:, (heads + kv) * hd:].view(8, kv, hd)
                kv4_attention.kv4_write(cache, k, v, _e(8, dtype=torch.int64))
                for b in batches:
                    label[0] = f"{tag} kv4 decode B={b} ctx={ctx}"
                    paged_decode.kv4_decode_attention(_e(b, heads, hd, dtype=dtype), cache,
                                                      _e(b, nb, dtype=torch.int64), _e(b, dtype=torch.int64),
                                                      hd ** -0.5, softcap=SOFTCAPS.get(name, 0.0))


def _fp16_paged_launches(label, ctx=4096):
    _, _, heads, kv, hd = ARCHS["llama-3-8b"]
    cache = _e(2, ctx // 16 * 64, 16, kv, hd)
    for b in (1, 64):
        label[0] = f"llama-3-8b fp16 paged decode (bench baseline) B={b} ctx={ctx}"
        paged_decode.fp16_paged_decode_attention(_e(b, heads, hd), cache, _e(b, ctx // 16, dtype=torch.int64),
                                                 _e(b, dtype=torch.int64), hd ** -0.5)


def _representative_gemms(label):
    """Every tile once (g128), every group size once (decode tile), one split-K
    shape and one with bias and bf16 output on GQA-3 shapes."""
    n, k = linears(*ARCHS["llama-3-8b"])["qkv"]
    for m in M_PER_BUCKET:
        label[0] = f"llama-3-8b qkv g128 M={m} float16"
        _gemm(m, n, k, 128, torch.float16, False)
    for group in GROUPS:
        label[0] = f"llama-3-8b qkv g{group} M=1 float16"
        _gemm(1, n, k, group, torch.float16, False)
    n, k = linears(*ARCHS["llama-3-8b"])["down"]
    label[0] = "llama-3-8b down g128 M=1 float16 (split K)"
    _gemm(1, n, k, 128, torch.float16, False)
    n, k = linears(*ARCHS["smollm2-135m"])["down"]
    label[0] = "smollm2-135m down g64 M=32 bfloat16 bias"
    _gemm(32, n, k, 64, torch.bfloat16, True)


def engine_launches(quick: bool = False) -> list[Launch]:
    """Every launch the engine can make: each architecture, dtype, bias, tile
    bucket, group size, page size 16 and 64. quick: a representative set that
    still reaches every kernel, tile and group size (the test suite's)."""
    modules = (act_quant, w4a8_gemm, paged_decode, kv4_attention)
    with recording(modules) as (sink, label):
        if quick:
            _representative_gemms(label)
            _act_launches(("llama-3-8b",), (torch.float16,), label)
            _kv_launches(QUICK_ARCHS, (torch.float16,), (16,), (1, 64), label)
            _kv_launches(("gemma-2-2b",), (torch.float16,), (16,), (1,), label)  # the soft-capped variant
        else:
            _gemm_launches(ARCHS, GROUPS, DTYPES, (False, True), label)
            _act_launches(ARCHS, DTYPES, label)
            _kv_launches(ARCHS, DTYPES, (16, 64), (1, 8, 64), label)
        _fp16_paged_launches(label)
    for launch in sink:
        # fp32 models on CUDA are a correctness configuration (tests, references),
        # not a served one: their exact fp32 dots may spill without failing the check
        if launch.kwargs.get("F32_DOT"):
            launch.hot = False
    return sink


def check(targets: list[int], quick: bool = False, progress=None) -> list[Result]:
    """Compile every engine variant (quick: a representative set) per target."""
    results = []
    launches = engine_launches(quick)
    for cc in targets:
        for launch in unique(launches, cc):
            res = compile_launch(launch, cc)
            results.append(res)
            if progress:
                progress(res)
    return results
