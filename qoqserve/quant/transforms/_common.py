"""Row/column views of the fused linears that the transforms rescale or permute."""
from __future__ import annotations

import torch


def heads(layer, num_heads, num_kv_heads, head_dim) -> tuple[int, int, int]:
    attn = layer.self_attn
    return (num_heads or attn.num_heads, num_kv_heads or attn.num_kv_heads,
            head_dim or attn.head_dim)


def qkv_slices(layer, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[slice, slice, slice]:
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    if layer.self_attn.qkv_proj.out_features != q + 2 * kv:
        raise ValueError(f"qkv_proj has {layer.self_attn.qkv_proj.out_features} rows, "
                         f"expected {q + 2 * kv} for H={num_heads} Hkv={num_kv_heads} D={head_dim}")
    return slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)


def update(param: torch.Tensor, fn) -> None:
    """param <- fn(param) computed in float64, rounded once on the way back."""
    param.copy_(fn(param.double()).to(param.dtype))


def scale_rows(lin, sl: slice, factor: torch.Tensor) -> None:
    """Multiply output rows `sl` of a linear (weight and bias) by factor [rows]."""
    update(lin.weight[sl], lambda w: w * factor[:, None])
    if lin.has_bias:
        update(lin.bias[sl], lambda b: b * factor)


def permute_rows(lin, sl: slice, perm: torch.Tensor) -> None:
    """Reorder output rows `sl` of a linear (weight and bias): new row i = old perm[i]."""
    update(lin.weight[sl], lambda w: w[perm])
    if lin.has_bias:
        update(lin.bias[sl], lambda b: b[perm])


def group_max(x: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[H*D] per query-head channel -> [Hkv, D], max over the heads of each GQA group."""
    g = num_heads // num_kv_heads
    return x.reshape(num_kv_heads, g, head_dim).amax(dim=1)


def expand_groups(x: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[Hkv, D] -> [H*D]: every query head takes its kv head's row."""
    return x.repeat_interleave(num_heads // num_kv_heads, dim=0).reshape(-1)
