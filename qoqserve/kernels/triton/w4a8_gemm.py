"""W4A8 GEMM: packed UINT4 weights unpacked in registers, expanded per group to
INT8 (s2 * (u - z)) right before an INT8 x INT8 -> INT32 tl.dot, then the
s_a * s1 epilogue (and, per channel, the zero-point correction with the
activation row sums). Weights are read in the checkpoint layout (docs/format.md).

Tiles come from a fixed table keyed on the M bucket (no autotuning in the
serving path). Decode-sized M splits K over several programs that add their
INT32 partial sums atomically (exact: integer addition is associative), and
a second small kernel applies the epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qoqserve.kernels.triton.common import unpack_uint4


@dataclass(frozen=True)
class Tile:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


# (largest M of the bucket, tile). First choices, to be tuned on a GPU
# (docs/kernels.md): tall-thin tiles with deep pipelines stream the weight
# once at decode M; square tiles reuse it at prefill M. 128x128 tiles keep
# BK at 64: with BK=128 they spill on sm_80 and sm_90 (qoqserve check-kernels).
M_BUCKETS = (
    (16, Tile(16, 64, 128, 4, 5)),
    (32, Tile(32, 64, 128, 4, 4)),
    (64, Tile(64, 64, 128, 4, 4)),
    (256, Tile(64, 128, 128, 8, 3)),
    (None, Tile(128, 128, 64, 8, 3)),
)
SPLIT_K_MAX_M = 64          # split K only where the M x N grid alone under-fills the GPU
EPILOGUE_TILE = (32, 128)   # the split-K epilogue kernel's block
MIN_DOT_K = 32              # an INT8 mma needs K >= 32 per step


def tile_for(m: int) -> Tile:
    for top, tile in M_BUCKETS:
        if top is None or m <= top:
            return tile
    raise AssertionError("the last bucket is open")


def block_k(tile: Tile, group: int) -> int:
    """The K step for a group size: a whole number of steps per group, so each
    step reads one (s2, z) pair per output channel. Raises for group sizes the
    kernel cannot serve (the checkpoint format itself accepts any)."""
    if group == 0:
        return tile.bk
    if group < MIN_DOT_K or group & (group - 1):
        raise ValueError(f"the Triton W4A8 GEMM supports group sizes that are powers of two "
                         f">= {MIN_DOT_K} (or 0, per channel); got {group}")
    return min(tile.bk, group)


def split_k_for(m: int, n: int, k: int, tile: Tile, bk: int, num_sms: int) -> int:
    """How many programs share the K loop of one output tile: enough to give
    every SM about two programs, keeping >= 8 K steps per program."""
    if m > SPLIT_K_MAX_M:
        return 1
    ctas = triton.cdiv(m, tile.bm) * triton.cdiv(n, tile.bn)
    steps = triton.cdiv(k, bk)
    want = triton.cdiv(2 * num_sms, ctas)
    return max(1, min(want, steps // 8, 16))


@triton.jit
def _epilogue(acc, rm, rn, m_ok, n_ok, sa_ptr, rowsum_ptr, z_ptr, s1_ptr, bias_ptr,
              PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    sa = tl.load(sa_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)
    s1 = tl.load(s1_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    y = acc.to(tl.float32) * sa[:, None] * s1[None, :]
    if PER_CHANNEL:
        rs = tl.load(rowsum_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)
        zs = tl.load(z_ptr + rn, mask=n_ok, other=0).to(tl.float32) * s1
        y = y - rs[:, None] * zs[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit(do_not_specialize=["M"])
def _w4a8_gemm_kernel(x_ptr, sa_ptr, rowsum_ptr, qw_ptr, s2_ptr, z_ptr, s1_ptr, bias_ptr, out_ptr,
                      M, N, K, stride_xm, stride_om, stride_wn, stride_gn, k_per_split,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_ACC: tl.constexpr,
                      ATOMIC: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rk2 = tl.arange(0, BK // 2)
    m_ok = rm < M
    n_ok = rn < N
    # 64-bit row offsets: M * N reaches 2^31 at large batched-token budgets
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = qw_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BK):
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & ((k0 + rk)[None, :] < k_hi),
                    other=0)
        kb = k0 // 2 + rk2
        packed = tl.load(w_rows + kb[None, :], mask=n_ok[:, None] & (kb[None, :] < k_hi // 2), other=0)
        u = unpack_uint4(packed, BN, BK).to(tl.int16)
        if GROUP > 0:
            # BK divides GROUP (block_k), so one step sits inside one group
            j = k0 // GROUP
            s2 = tl.load(s2_ptr + rn * stride_gn + j, mask=n_ok, other=0).to(tl.int16)
            z = tl.load(z_ptr + rn * stride_gn + j, mask=n_ok, other=0).to(tl.int16)
            w = ((u - z[:, None]) * s2[:, None]).to(tl.int8)
        else:
            w = u.to(tl.int8)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.int32)
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=ok, sem="relaxed")
    elif OUT_ACC:
        tl.store(out_ptrs, acc, mask=ok)
    else:
        y = _epilogue(acc, rm, rn, m_ok, n_ok, sa_ptr, rowsum_ptr, z_ptr, s1_ptr, bias_ptr,
                      GROUP == 0, HAS_BIAS)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _w4a8_epilogue_kernel(acc_ptr, sa_ptr, rowsum_ptr, z_ptr, s1_ptr, bias_ptr, out_ptr, M, N,
                          PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(acc_ptr + offs, mask=ok, other=0)
    y = _epilogue(acc, rm, rn, m_ok, n_ok, sa_ptr, rowsum_ptr, z_ptr, s1_ptr, bias_ptr, PER_CHANNEL,
                  HAS_BIAS)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; elsewhere (the interpreter) an H200's 132."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _check(name: str, t: torch.Tensor, dtypes, shape) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected one of {dtypes}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def w4a8_gemm(x_q: torch.Tensor, s_a: torch.Tensor, qweight: torch.Tensor, s1: torch.Tensor,
              zeros: torch.Tensor, s2: torch.Tensor | None = None, group_size: int = 0,
              rowsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float16, return_acc: bool = False,
              split_k: int | None = None) -> torch.Tensor:
    """x_q int8 [M, K] (s_a fp32 [M]) times the packed weight [N, K/2] -> [M, N].

    return_acc gives the raw INT32 accumulator, for bit-exact checks; split_k
    overrides the automatic K split (1: none).
    """
    m, k = x_q.shape
    n = qweight.shape[0]
    if x_q.dtype != torch.int8:
        raise ValueError(f"x_q must be int8, got {x_q.dtype}")
    if qweight.shape[1] * 2 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not match K={k}")
    if group_size and k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    if not group_size and rowsum is None and not return_acc:
        raise ValueError("the per-channel epilogue needs the activation row sums")
    tile = tile_for(m)
    bk = block_k(tile, group_size)
    _check("qweight", qweight, (torch.uint8,), (n, k // 2))
    _check("s1", s1, (torch.float16, torch.float32), (n,))
    _check("s_a", s_a, (torch.float32,), (m,))
    if group_size:
        if s2 is None:
            raise ValueError("per-group weights need s2")
        _check("s2", s2, (torch.uint8,), (n, k // group_size))
        _check("zeros", zeros, (torch.uint8,), (n, k // group_size))
    else:
        _check("zeros", zeros, (torch.uint8,), (n,))
    if rowsum is not None:
        _check("rowsum", rowsum, (torch.float32,), (m,))
    if bias is not None:
        _check("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (n,))
    x_q = x_q.contiguous()
    if split_k is None:
        split_k = split_k_for(m, n, k, tile, bk, num_sms(x_q.device))
    k_per_split = triton.cdiv(triton.cdiv(k, bk), split_k) * bk
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    acc_out = return_acc or split_k > 1
    if acc_out:
        make = torch.zeros if split_k > 1 else torch.empty
        out = make(m, n, dtype=torch.int32, device=x_q.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out if return_acc else out.to(out_dtype)
    dummy = s1
    rowsum = rowsum if rowsum is not None else dummy
    bias_arg = bias if bias is not None else dummy
    s2_arg = s2 if s2 is not None else zeros
    grid = (triton.cdiv(m, tile.bm), triton.cdiv(n, tile.bn), split_k)
    _w4a8_gemm_kernel[grid](
        x_q, s_a, rowsum, qweight, s2_arg, zeros, s1, bias_arg, out,
        m, n, k, x_q.stride(0), out.stride(0), k // 2, k // group_size if group_size else 0,
        # the atomic (split) variant ignores bias and output mode: one variant, not four
        k_per_split, GROUP=group_size, HAS_BIAS=bias is not None and split_k == 1,
        OUT_ACC=return_acc and split_k == 1, ATOMIC=split_k > 1, BM=tile.bm, BN=tile.bn, BK=bk,
        num_warps=tile.warps, num_stages=tile.stages)
    if return_acc or split_k == 1:
        return out
    y = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    ebm, ebn = EPILOGUE_TILE
    _w4a8_epilogue_kernel[(triton.cdiv(m, ebm), triton.cdiv(n, ebn))](
        out, s_a, rowsum, zeros, s1, bias_arg, y, m, n, PER_CHANNEL=group_size == 0,
        HAS_BIAS=bias is not None, BM=ebm, BN=ebn, num_warps=4)
    return y
