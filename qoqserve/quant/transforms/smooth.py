"""Smoothing (SmoothQuant-style) and SmoothAttention, folded into the weights.

A per-channel scale s moves activation range into the weight: X W^T =
(X / s)(W s)^T. It is only free when X / s can be produced by the layer that
computes X, so each transform names the producer it folds into: up rows for
down_proj inputs (silu(gate) * up is linear in up), v rows for o_proj inputs
(attention output is a convex mix of v), q/k rows for the attention scores,
and the RMSNorm weight before qkv_proj or gate_up_proj for their inputs.
"""
from __future__ import annotations

import torch

from ._common import expand_groups, group_max, heads, qkv_slices, scale_rows, update

_MIN = 1e-5


def smooth_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor,
                  alpha: float) -> torch.Tensor:
    """s = act^alpha / weight^(1 - alpha), guarded against zero/NaN channels.

    A dead channel (absmax 0) would give s = 0 or inf and poison the folded
    weights, so inputs and result are clamped at 1e-5 and NaN/inf become 1.
    """
    a = torch.nan_to_num(act_absmax.double(), nan=1.0).clamp(min=_MIN)
    w = torch.nan_to_num(weight_absmax.double(), nan=1.0).clamp(min=_MIN)
    s = a.pow(alpha) / w.pow(1 - alpha)
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp(min=_MIN)


@torch.no_grad()
def smooth_input(norm, linear, act_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Divide the input channel j of a linear that reads an RMSNorm's output by
    s_j: the norm's weight / s, the linear's columns * s (SmoothQuant's fold,
    for the block inputs a residual rotation does not reach). Returns s (float64)."""
    s = smooth_scales(act_absmax.to(linear.weight.device), linear.weight.detach().abs().amax(dim=0), alpha)
    update(norm.weight, lambda w: w / s)
    update(linear.weight, lambda w: w * s[None, :])
    return s


@torch.no_grad()
def smooth_down(layer, act_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Divide down_proj input channel j by s_j: up rows / s, down columns * s.

    act_absmax [I]: max |silu(gate) * up| per channel over calibration tokens.
    Returns s [I] (float64).
    """
    gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    inter = down.in_features
    dev = down.weight.device
    w_absmax = down.weight.detach().abs().amax(dim=0)
    s = smooth_scales(act_absmax.to(dev), w_absmax, alpha)
    # gate must stay untouched: silu is not homogeneous, up enters linearly
    scale_rows(gate_up, slice(inter, 2 * inter), 1 / s)
    update(down.weight, lambda w: w * s[None, :])
    return s


@torch.no_grad()
def smooth_out_proj(layer, act_absmax: torch.Tensor, alpha: float, num_heads: int | None = None,
                    num_kv_heads: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """Divide o_proj input channel (h, d) by s[h // group, d], folded into v rows.

    act_absmax [H*D]: attention output absmax per channel. One v head feeds all
    query heads of its GQA group, so s lives on [Hkv, D]: act and weight
    absmax are reduced with max over the group's heads. Returns s [Hkv, D].
    """
    h, hkv, d = heads(layer, num_heads, num_kv_heads, head_dim)
    o, qkv = layer.self_attn.o_proj, layer.self_attn.qkv_proj
    dev = o.weight.device
    _, _, v_rows = qkv_slices(layer, h, hkv, d)
    act = group_max(act_absmax.to(dev).double(), h, hkv, d)
    wmax = group_max(o.weight.detach().abs().amax(dim=0).double(), h, hkv, d)
    s = smooth_scales(act, wmax, alpha)                     # [Hkv, D]
    scale_rows(qkv, v_rows, 1 / s.reshape(-1))
    cols = expand_groups(s, h, hkv)                           # [H*D]
    update(o.weight, lambda w: w * cols[None, :])
    return s


def pair_max(x: torch.Tensor, rotary: int | None = None) -> torch.Tensor:
    """[..., D] -> [..., D] with entries i and i + R/2 both set to their max,
    for i < R/2 (R = rotary, default D); entries from R on kept.

    RoPE (half-split) mixes channel i with i + R/2 by a 2x2 rotation; a
    diagonal scale commutes with it only if both channels share the factor.
    Partial rotary embeddings (R < D) leave the channels from R unturned.
    """
    rot = rotary or x.shape[-1]
    half = rot // 2
    m = torch.maximum(x[..., :half], x[..., half:rot])
    return torch.cat([m, m, x[..., rot:]], dim=-1)


def smooth_attention_lambda(key_absmax: torch.Tensor, alpha: float, rotary: int | None = None) -> torch.Tensor:
    """[Hkv, D] post-RoPE key absmax -> pair-equal lambda [Hkv, D] (float64),
    pairs as RoPE turns them over its `rotary` first channels (default all)."""
    ka = torch.nan_to_num(key_absmax.double(), nan=1.0)
    return pair_max(ka.clamp(min=_MIN).pow(alpha), rotary)


@torch.no_grad()
def smooth_attention(layer, key_absmax: torch.Tensor, alpha: float = 0.5,
                     num_heads: int | None = None, num_kv_heads: int | None = None,
                     head_dim: int | None = None, rotary: int | None = None) -> torch.Tensor:
    """SmoothAttention: q rows * lambda, k rows / lambda (biases too), so
    q.k is unchanged while keys (quantized to 4 bit) lose their outlier channels.

    key_absmax [Hkv, D] is measured on POST-RoPE keys by the caller; since
    lambda is pair-equal, post-RoPE k / lambda is exactly what the smoothed
    model produces. rotary: the channels RoPE turns (partial rotary
    embeddings), default all. Returns lambda [Hkv, D] (float64).
    """
    h, hkv, d = heads(layer, num_heads, num_kv_heads, head_dim)
    qkv = layer.self_attn.qkv_proj
    q_rows, k_rows, _ = qkv_slices(layer, h, hkv, d)
    lam = smooth_attention_lambda(key_absmax.to(qkv.weight.device).reshape(hkv, d), alpha, rotary)
    scale_rows(qkv, q_rows, expand_groups(lam, h, hkv))
    scale_rows(qkv, k_rows, 1 / lam.reshape(-1))
    return lam
