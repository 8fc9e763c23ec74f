"""Channel reordering for group quantization (QoQ, g128).

Sorting a linear's input channels by activation absmax puts channels of
similar range into the same quantization group. The permutation is free when
the producer of those channels emits them in the new order: gate/up rows for
down_proj, v rows for o_proj. Permutations returned map new -> old: new input
channel i of the linear is old channel perm[i].
"""
from __future__ import annotations

import torch

from ._common import group_max, heads, permute_rows, qkv_slices, update


@torch.no_grad()
def reorder_down(layer, act_absmax: torch.Tensor) -> torch.Tensor:
    """Sort down_proj input channels by act_absmax [I], descending.

    silu(gate) * up is elementwise, so permuting gate and up rows alike
    permutes its output channels. Returns perm [I].
    """
    gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    inter = down.in_features
    perm = torch.argsort(act_absmax.to(down.weight.device), descending=True, stable=True)
    permute_rows(gate_up, slice(0, inter), perm)
    permute_rows(gate_up, slice(inter, 2 * inter), perm)
    update(down.weight, lambda w: w[:, perm])
    return perm


@torch.no_grad()
def reorder_out_proj(layer, act_absmax: torch.Tensor, num_heads: int | None = None,
                     num_kv_heads: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """Sort o_proj input channels within each head by act_absmax [H*D], descending.

    Attention mixes tokens per head, so only a permutation of a v head's own
    channels commutes with it; GQA groups share one v head, hence one order per
    kv head, from the group-reduced (max) absmax.

    Note: with group_size >= head_dim (a multiple of it, e.g. g128 over D=64 or
    128) every quantization group holds whole heads, so a within-head
    permutation cannot change any group's membership: a no-op for accuracy.
    It only matters for group sizes below head_dim. Returns perm [H*D] over
    o_proj columns.
    """
    h, hkv, d = heads(layer, num_heads, num_kv_heads, head_dim)
    qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
    v_rows = qkv_slices(layer, h, hkv, d)[2]
    dev = o.weight.device
    key = group_max(act_absmax.to(dev), h, hkv, d)                       # [Hkv, D]
    within = torch.argsort(key, dim=1, descending=True, stable=True)     # [Hkv, D]
    base = torch.arange(hkv, device=dev)[:, None] * d
    permute_rows(qkv, v_rows, (within + base).reshape(-1))
    g = h // hkv
    per_head = within.repeat_interleave(g, dim=0)                        # [H, D]
    perm = (per_head + torch.arange(h, device=dev)[:, None] * d).reshape(-1)
    update(o.weight, lambda w: w[:, perm])
    return perm
