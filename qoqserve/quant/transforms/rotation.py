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
        pairs.append((layer.post_attention_layernorm, [layer.mlp.gate_up_proj.weight]))
    pairs.append((model.norm, [model.lm_head]))
    for norm, weights in pairs:
        w = norm.weight.double()
        for weight in weights:
            _update(weight, lambda x: x * w[None, :])
        norm.weight.fill_(1.0)


@torch.no_grad()
def rotate_model(model, seed: int | None = 0) -> torch.Tensor:
    """Fold norms, then rotate the residual stream by Q = orthogonal_matrix(hidden).

    Returns Q (float64, [hidden, hidden]); the residual stream of the rotated
    model is h_old @ Q.
    """
    fold_norms(model)
    q = orthogonal_matrix(model.cfg.hidden_size, seed, dtype=torch.float64)
    q = q.to(model.embed_tokens.device)
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
