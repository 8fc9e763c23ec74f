"""Block-input rotation (QoQ / QuaRot): rotate the residual stream by an
orthogonal Q so activation outliers are spread over all channels.

RMSNorm commutes with an orthogonal rotation only when its weight is all
ones (||xQ|| = ||x||, but diag(w) Q != Q diag(w)), so norm weights are folded
into the linears that read them first. After that, h -> hQ throughout: every
writer of the residual produces hQ, every reader undoes Q on its input side.
"""
from __future__ import annotations

import torch
from torch import nn

from qoqserve.quant.hadamard import orthogonal_matrix

# float64 inside, so rounding happens once, at the cast back
from ._common import update as _update

_CHUNK_ROWS = 16384


def _untie_lm_head(model) -> None:
    # lm_head gets the final norm folded in, embeddings do not: they must
    # become two tensors (and stay two: a tied reload would re-merge them)
    if model.lm_head is model.embed_tokens:
        model.lm_head = nn.Parameter(model.embed_tokens.detach().clone(), requires_grad=False)
    model.cfg.tie_word_embeddings = False


@torch.no_grad()
def fold_norms(model) -> None:
    """Fold each RMSNorm weight into the input columns of the linears it feeds
    and set the norm weight to 1; unties lm_head from the embeddings."""
    _untie_lm_head(model)
    pairs = []
    for layer in model.layers:
        pairs.append((layer.input_layernorm, [layer.self_attn.qkv_proj.weight]))
        pairs.append((layer.mlp_input_norm, [layer.mlp.gate_up_proj.weight]))
    pairs.append((model.norm, [model.lm_head]))
    for norm, weights in pairs:
        w = norm.weight.double()
        for weight in weights:
            _update(weight, lambda x: x * w[None, :])
        norm.weight.fill_(1.0)


@torch.no_grad()
def rotate_model(model, seed: int | None = 0, q: torch.Tensor | None = None) -> torch.Tensor:
    """Fold norms (a no-op when already folded), then rotate the residual stream
    by Q: `q` when given (e.g. a learned rotation), else orthogonal_matrix(hidden, seed).

    Returns Q (float64, [hidden, hidden]); the residual stream of the rotated
    model is h_old @ Q.
    """
    fold_norms(model)
    if q is None:
        q = orthogonal_matrix(model.cfg.hidden_size, seed, dtype=torch.float64)
    q = q.double().to(model.embed_tokens.device)
    # readers: x W^T with x = hQ needs W Q (so that hQ Q^T W^T = h W^T)
    readers = [model.embed_tokens, model.lm_head]
    writers = []
    for layer in model.layers:
        readers += [layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight]
        writers += [layer.self_attn.o_proj, layer.mlp.down_proj]
    for w in readers:  # embedding rows are residual vectors: E Q as well
        # row chunks: a float64 copy of a 128k-vocab embedding would cost GBs
        for rows in w.split(_CHUNK_ROWS):
            _update(rows, lambda x: x @ q)
    for lin in writers:  # writers must output (a W^T + b) Q = a (Q^T W)^T + b Q
        _update(lin.weight, lambda x: q.T @ x)
        if lin.has_bias:
            _update(lin.bias, lambda x: x @ q)
    return q


@torch.no_grad()
def rotate_values(model, seed: int | None = 0) -> torch.Tensor:
    """Rotate every value head by an orthogonal R [D, D], folded into v_proj and o_proj.

    Attention output is P V per head, so V R flows through to the o_proj input
    as (P V) R and o_proj undoes it with W_o R (per head block). V's channel
    outliers are spread over the head before KV4 quantization; keys cannot get
    the same offline treatment because RoPE does not commute with R.
    """
    d = model.cfg.head_dim
    h, hkv = model.cfg.num_heads, model.cfg.num_kv_heads
    r = orthogonal_matrix(d, None if seed is None else seed + 1, dtype=torch.float64)
    r = r.to(model.embed_tokens.device)
    for layer in model.layers:
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        v0 = (h + hkv) * d
        for j in range(hkv):  # v' = x W_v^T R  ->  W_v' = R^T W_v (rows of head j)
            rows = slice(v0 + j * d, v0 + (j + 1) * d)
            _update(qkv.weight[rows], lambda x: r.T @ x)
            if qkv.has_bias:
                _update(qkv.bias[rows], lambda x: x @ r)
        for i in range(h):  # o = out' (W_o R)^T per query head's column block
            _update(o.weight[:, i * d:(i + 1) * d], lambda x: x @ r)
    return r
