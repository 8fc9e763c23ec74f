"""Torch reference of every QoQ numeric (W4A8KV4).

Shared by the offline quantizer and the runtime engine, so a checkpoint is
quantized with exactly the arithmetic the engine later undoes. Only torch.

Formats (see DESIGN.md "QoQ facts"):
- group (g64/g128): w ~= s1[n] * s2[n,g] * (u - z[n,g]); s1 fp16, s2/z/u integers.
- channel:          w ~= s1[n] * (u - z[n]);             s1 fp16, z/u integers.
- activations: int8 symmetric per token (the KV cache's formats: kv_ref.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qoqserve.kernels.cpu import isa as cpu_isa

PROTECT = 119  # level-1 range: with s2 <= 16, s2*(u-z) of any code stays in int8
# |a|,|b| <= 128 -> K * 2^14 must stay below 2^31 or the int32 accumulator wraps.
INT8_MM_MAX_K = (2**31 - 1) // (128 * 128)
# fp32 sums integer products exactly while every partial sum stays within
# 2^24: 1024 products of magnitude <= 128 * 128 each, in any order
FP32_EXACT_K = 2**24 // (128 * 128)
FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal)


# ----------------------------------------------------------------- packing
def pack_uint4(u: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 -> [..., K//2] bytes; low nibble = even k, high = odd k."""
    if u.shape[-1] % 2:
        raise ValueError(f"pack_uint4 needs an even last dim, got {tuple(u.shape)}")
    u = u.to(torch.uint8)
    if u.numel() and int(u.max()) > 15:
        raise ValueError("pack_uint4: codes must be in 0..15")
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_uint4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_uint4: [..., K//2] bytes -> [..., K] codes."""
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def _round_up_fp16(v: torch.Tensor) -> torch.Tensor:
    """Smallest positive fp16 >= v. Scales rounded *down* to fp16 would make the
    extreme weight exceed the code range and be clamped; rounding up keeps the
    textbook half-step error bound exact."""
    h = v.clamp(min=FP16_TINY).half()
    low = h.float() < v
    h = torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    if not torch.isfinite(h).all():
        raise ValueError("weight scale overflows fp16 (|w| too large)")
    return h


def _clip_ratio(clip, n: int, device) -> torch.Tensor:
    if clip is None:
        return torch.ones(n, device=device)
    return torch.as_tensor(clip, dtype=torch.float32, device=device).expand(n)


# ------------------------------------------------------- progressive group W4
@dataclass
class QWeightGroup:
    s1: torch.Tensor  # fp16 [N]
    s2: torch.Tensor  # uint8 [N, K//g], 1..16
    z: torch.Tensor   # uint8 [N, K//g], 0..15
    u: torch.Tensor   # uint8 [N, K], 0..15 (unpacked)
    group_size: int


def level1_scale(w: torch.Tensor, clip=None) -> torch.Tensor:
    """Per-row symmetric INT8 scale s1 = clip*amax/119, as the fp16 that is stored."""
    amax = w.float().abs().amax(dim=1) * _clip_ratio(clip, w.shape[0], w.device)
    return _round_up_fp16(amax / PROTECT)


def level1_codes(w: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
    """Level 1: w / s1 rounded and held to the protective INT8 range."""
    return torch.clamp(torch.round(w.float() / s1.float()[:, None]), -PROTECT, PROTECT)


def level2_params(q1: torch.Tensor):
    """Integer asymmetric UINT4 over the last dim of an INT8-valued float tensor.

    Zero is kept inside [lo, hi] so z is a true integer in 0..15. The range is
    <= 238, so s2 <= 16 and s2*15 <= 240 fits uint8. z is additionally kept in
    [15 - 127//s2, 128//s2], which makes s2*(u-z) fit int8 for all 16 codes,
    not only for the ones that occur; tests check exhaustively that this never
    costs more than s2/2 of rounding error.
    """
    lo = q1.amin(dim=-1).clamp(max=0)
    hi = q1.amax(dim=-1).clamp(min=0)
    s2 = torch.clamp(torch.ceil((hi - lo) / 15), min=1)
    z_lo = torch.clamp(15 - torch.floor(127 / s2), min=0)
    z_hi = torch.clamp(torch.floor(128 / s2), max=15)
    z = torch.minimum(torch.maximum(torch.round(-lo / s2), z_lo), z_hi)
    u = torch.clamp(torch.round(q1 / s2[..., None]) + z[..., None], 0, 15)
    return s2, z, u


def quantize_group_columns(w_cols: torch.Tensor, s1: torch.Tensor):
    """Level 2 for one group of columns [N, g] given the stored s1 -> (s2, z, u) uint8."""
    s2, z, u = level2_params(level1_codes(w_cols, s1))
    return s2.to(torch.uint8), z.to(torch.uint8), u.to(torch.uint8)


def quantize_weight_group(w: torch.Tensor, group_size: int, clip=None) -> QWeightGroup:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    s1 = level1_scale(w, clip)
    q1 = level1_codes(w, s1).view(n, k // group_size, group_size)
    s2, z, u = level2_params(q1)
    return QWeightGroup(s1, s2.to(torch.uint8), z.to(torch.uint8),
                        u.reshape(n, k).to(torch.uint8), group_size)


def group_weight_to_int8(q: QWeightGroup) -> torch.Tensor:
    n, k = q.u.shape
    u = q.u.view(n, k // q.group_size, q.group_size).to(torch.int16)
    w8 = (u - q.z.to(torch.int16)[..., None]) * q.s2.to(torch.int16)[..., None]
    return w8.reshape(n, k).to(torch.int8)


def group_weight_to_float(q: QWeightGroup) -> torch.Tensor:
    return q.s1.float()[:, None] * group_weight_to_int8(q).float()


# ------------------------------------------------------------ per-channel W4
@dataclass
class QWeightChannel:
    s1: torch.Tensor  # fp16 [N]
    z: torch.Tensor   # uint8 [N], 0..15
    u: torch.Tensor   # uint8 [N, K], 0..15 (unpacked)


def channel_params(w: torch.Tensor, clip=None):
    """Per-row asymmetric UINT4 (s1 fp16, z float integer); zero kept in range."""
    r = _clip_ratio(clip, w.shape[0], w.device)
    lo = w.float().amin(dim=1).clamp(max=0) * r
    hi = w.float().amax(dim=1).clamp(min=0) * r
    s1 = _round_up_fp16((hi - lo) / 15)
    z = torch.clamp(torch.round(-lo / s1.float()), 0, 15)
    return s1, z


def _channel_codes(w, s1, z):
    return torch.clamp(torch.round(w.float() / s1.float()[:, None]) + z[:, None], 0, 15)


def quantize_weight_channel(w: torch.Tensor, clip=None) -> QWeightChannel:
    s1, z = channel_params(w, clip)
    return QWeightChannel(s1, z.to(torch.uint8), _channel_codes(w, s1, z).to(torch.uint8))


def channel_weight_to_float(q: QWeightChannel) -> torch.Tensor:
    return q.s1.float()[:, None] * (q.u.float() - q.z.float()[:, None])


# ------------------------------------------------------------- activations
def quantize_act_int8(x: torch.Tensor):
    """Symmetric per-token INT8: x [..., K] -> (int8 [..., K], fp32 scale [...])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    x_q = torch.clamp(torch.round(xf / scale[..., None]), -127, 127)
    return x_q.to(torch.int8), scale


def act_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of the *unquantized* row, for the per-channel zero-point epilogue."""
    return x.float().sum(dim=-1)


def int8_mm(a: torch.Tensor, b_t: torch.Tensor, _pad_like_cuda: bool = False) -> torch.Tensor:
    """Exact int32 a[M,K] @ b_t[N,K]^T for int8 operands.

    CPU torch._int_mm accepts any shape; CUDA needs M > 16 and K, N multiples
    of 8, so there we zero-pad (exact). On CPUs where torch has no INT8 GEMM
    kernel (below AVX-512) it runs a reference loop tens of times slower than
    fp32 matmul, so there the products are summed in fp32 over K slices short
    enough to stay exact. Where _int_mm cannot run at all we use float64,
    exact because |sum| < 2^31 < 2^53.
    """
    m, k = a.shape
    n = b_t.shape[0]
    if k > INT8_MM_MAX_K:
        raise ValueError(f"K={k} could overflow the int32 accumulator")
    if a.is_cuda or _pad_like_cuda:
        kp, np_ = -(-k // 8) * 8, -(-n // 8) * 8
        a = F.pad(a, (0, kp - k, 0, max(17 - m, 0)))
        b_t = F.pad(b_t, (0, kp - k, 0, np_ - n))
    elif not cpu_has_int8_gemm():
        return exact_fp32_int_mm(a, b_t)
    try:
        out = torch._int_mm(a, b_t.t())
    except RuntimeError:
        out = (a.double() @ b_t.double().t()).to(torch.int32)
    return out[:m, :n]


def cpu_has_int8_gemm() -> bool:
    """torch's CPU INT8 GEMM (oneDNN) has a vector kernel from AVX-512 on;
    below it _int_mm is a scalar loop."""
    return cpu_isa.torch_has_avx512_kernels()


def exact_fp32_int_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a[M,K] @ b_t[N,K]^T for int8 / uint8 operands as fp32 GEMMs over K
    slices of FP32_EXACT_K, each exact, added in int32: the same integers as
    torch._int_mm, at the fp32 GEMM's speed."""
    out = None
    for k0 in range(0, a.shape[1], FP32_EXACT_K):
        part = (a[:, k0:k0 + FP32_EXACT_K].float() @ b_t[:, k0:k0 + FP32_EXACT_K].float().t()).to(torch.int32)
        out = part if out is None else out.add_(part)
    if out is None:
        out = torch.zeros(a.shape[0], b_t.shape[0], dtype=torch.int32)
    return out


def _flat(x):
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def w4a8_group_linear(x, w_int8, s1) -> torch.Tensor:
    """y = s_a * s1 * (x_q @ w_int8^T) on INT8 math; x [..., K] -> fp32 [..., N]."""
    x2, lead = _flat(x)
    x_q, s_a = quantize_act_int8(x2)
    acc = int8_mm(x_q, w_int8).float()
    return (acc * s_a[:, None] * s1.float()).reshape(*lead, -1)


def w4a8_group_linear_sim(x, w_int8, s1) -> torch.Tensor:
    """fp32 twin of w4a8_group_linear (w_int8 may be int8 or its float copy)."""
    x2, lead = _flat(x)
    x_q, s_a = quantize_act_int8(x2)
    acc = x_q.float() @ w_int8.float().t()
    return (acc * s_a[:, None] * s1.float()).reshape(*lead, -1)


def _channel_epilogue(acc, s_a, x2, s1, z, lead):
    s1f = s1.float()
    y = acc * s_a[:, None] * s1f - act_row_sum(x2)[:, None] * (z.float() * s1f)
    return y.reshape(*lead, -1)


def w4a8_channel_linear(x, u, s1, z) -> torch.Tensor:
    """y = s_a*s1*(x_q @ u^T) - (z*s1)*rowsum(x) on INT8 math (u = codes 0..15)."""
    x2, lead = _flat(x)
    x_q, s_a = quantize_act_int8(x2)
    u8 = u.view(torch.int8) if u.dtype == torch.uint8 else u.to(torch.int8)  # 0..15: same bits
    acc = int8_mm(x_q, u8).float()
    return _channel_epilogue(acc, s_a, x2, s1, z, lead)


def w4a8_channel_linear_sim(x, u, s1, z) -> torch.Tensor:
    x2, lead = _flat(x)
    x_q, s_a = quantize_act_int8(x2)
    return _channel_epilogue(x_q.float() @ u.float().t(), s_a, x2, s1, z, lead)
