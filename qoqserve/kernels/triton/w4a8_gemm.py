"""W4A8 GEMM: packed UINT4 weights unpacked in registers, expanded per group to
INT8 (s2 * (u - z)) right before an INT8 x INT8 -> INT32 tl.dot, then the
s_a * s1 epilogue (and, per channel, the zero-point correction with the
activation row sums). Weights are read in the checkpoint layout (docs/format.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qoqserve.kernels.triton.common import unpack_uint4


@triton.jit
def _w4a8_gemm_kernel(x_ptr, sa_ptr, rowsum_ptr, qw_ptr, s2_ptr, z_ptr, s1_ptr, bias_ptr, out_ptr,
                      M, N, K, stride_xm, stride_om,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_ACC: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rk2 = tl.arange(0, BK // 2)
    m_ok = rm < M
    n_ok = rn < N
    half_k = K // 2
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & ((k0 + rk)[None, :] < K), other=0)
        kb = k0 // 2 + rk2
        packed = tl.load(qw_ptr + rn[:, None].to(tl.int64) * half_k + kb[None, :],
                         mask=n_ok[:, None] & (kb[None, :] < half_k), other=0)
        u = unpack_uint4(packed, BN, BK).to(tl.int16)
        if GROUP > 0:
            # BK divides GROUP, so one tile sits inside one group
            j = k0 // GROUP
            s2 = tl.load(s2_ptr + rn * (K // GROUP) + j, mask=n_ok, other=0).to(tl.int16)
            z = tl.load(z_ptr + rn * (K // GROUP) + j, mask=n_ok, other=0).to(tl.int16)
            w = ((u - z[:, None]) * s2[:, None]).to(tl.int8)
        else:
            w = u.to(tl.int8)
        acc += tl.dot(x, tl.trans(w))
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if OUT_ACC:
        tl.store(out_ptrs, acc, mask=ok)
    else:
        sa = tl.load(sa_ptr + rm, mask=m_ok, other=0.0)
        s1 = tl.load(s1_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * sa[:, None] * s1[None, :]
        if GROUP == 0:
            rs = tl.load(rowsum_ptr + rm, mask=m_ok, other=0.0)
            zs = tl.load(z_ptr + rn, mask=n_ok, other=0).to(tl.float32) * s1
            y = y - rs[:, None] * zs[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _blocks(m: int, group: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps): decode-sized M wants tall-thin tiles that stream
    the weights once; prefill-sized M wants square tiles that reuse them."""
    bk = 128 if group in (0, 128) else 64
    if m <= 16:
        return 16, 64, bk, 4
    if m <= 64:
        return 32, 128, bk, 4
    if m <= 256:
        return 64, 128, bk, 8
    return 128, 128, bk, 8


def w4a8_gemm(x_q: torch.Tensor, s_a: torch.Tensor, qweight: torch.Tensor, s1: torch.Tensor,
              zeros: torch.Tensor, s2: torch.Tensor | None = None, group_size: int = 0,
              rowsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float16, return_acc: bool = False) -> torch.Tensor:
    """x_q int8 [M, K] (s_a fp32 [M]) times the packed weight [N, K/2] -> [M, N].

    return_acc gives the raw INT32 accumulator, for bit-exact checks.
    """
    m, k = x_q.shape
    n = qweight.shape[0]
    if qweight.shape[1] * 2 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not match K={k}")
    if group_size and k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    if not group_size and rowsum is None and not return_acc:
        raise ValueError("the per-channel epilogue needs the activation row sums")
    x_q = x_q.contiguous()
    bm, bn, bk, warps = _blocks(m, group_size)
    out = torch.empty(m, n, dtype=torch.int32 if return_acc else out_dtype, device=x_q.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    dummy = s1
    _w4a8_gemm_kernel[grid](
        x_q, s_a, rowsum if rowsum is not None else dummy, qweight,
        s2 if s2 is not None else zeros, zeros, s1, bias if bias is not None else dummy, out,
        m, n, k, x_q.stride(0), out.stride(0),
        GROUP=group_size, HAS_BIAS=bias is not None, OUT_ACC=return_acc,
        BM=bm, BN=bn, BK=bk, num_warps=warps)
    return out
