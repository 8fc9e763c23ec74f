"""A post-RoPE change of q and k that attention cannot see but a 4-bit K cache can.

    k' = (k - shift) R        q' = q R        (R orthogonal, per KV head: shift [Hkv, D])

q'.k' = q.k - q.shift: the subtracted term is the same for every key a query
attends to, so the softmax, and the layer's output, are unchanged (not where
the scores are soft-capped, Gemma 2: the quantizer leaves the shift 0 there). What
changes is what per-token KV4 sees: keys carry a large per-channel offset
(shared by all tokens) and a few outlier channels. Subtracting the calibrated
mean removes the first; the Hadamard-like R spreads the second over all
channels (what that buys on SmolLM2: docs/accuracy.md). It runs on q and k
before the cache write, so every KV layout and attention kernel works unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from qoqserve.layers.linear import materialize


class KeyTransform(nn.Module):
    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_heads: tuple[int, int] | None = None):
        """kv_heads: (first, count) of the checkpoint's KV heads this rank keeps
        (tensor parallelism; None: all of them)."""
        super().__init__()
        # identity until a checkpoint (or the quantizer) fills them in
        self.shift = nn.Parameter(torch.zeros(num_kv_heads, head_dim, dtype=dtype), requires_grad=False)
        self.rotation = nn.Parameter(torch.eye(head_dim, dtype=dtype), requires_grad=False)
        self._scales: torch.Tensor | None = None  # hadamard_scales(), for the R it was worked out from:
        self._scales_for: tuple[int, int] | None = None  # (data_ptr, version)
        if kv_heads is not None:
            self.shift.weight_loader = lambda param, loaded, _part: param.copy_(
                materialize(loaded.narrow(0, *kv_heads)))

    def hadamard_scales(self) -> torch.Tensor | None:
        """c [D] where R = H diag(c) exactly, H the Sylvester +-1 Hadamard
        matrix of order D (a power of two): the shipped checkpoints' signed
        Hadamard / sqrt(D), which the CPU kernels then apply as a fast
        Walsh-Hadamard transform (D log2 D sums instead of D^2 multiply-adds);
        None for any other R. Worked out once per value of R (kept until R is
        written again)."""
        r = self.rotation
        key = (r.data_ptr(), r._version)
        if self._scales_for != key:
            d = r.shape[0]
            scales = None
            if d & (d - 1) == 0 and r.dim() == 2 and r.shape == (d, d):
                scales = r[0].contiguous()
                if not torch.equal(r, sylvester(d, r.dtype, r.device) * scales):
                    scales = None
            self._scales, self._scales_for = scales, key
        return self._scales

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> the transformed pair, same shapes and dtypes."""
        r = self.rotation
        return q @ r, (k - self.shift) @ r


def sylvester(d: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order d (a power of two): H[i, j] =
    (-1)^popcount(i & j)."""
    i = torch.arange(d, device=device)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def share_equal_rotations(model: nn.Module) -> int:
    """Point the KeyTransforms whose R are equal at one tensor; returns how
    many distinct R are left. The shipped checkpoints give every layer the
    same signed Hadamard: shared, a decode step reads one R (D*D floats) that
    stays in cache instead of one cold copy a layer, each on the path from
    the qkv projection to attention. For a model whose weights are final:
    an R changed in place afterwards changes every layer that shares it.
    Each R's Hadamard scales (hadamard_scales) are worked out here too."""
    kept: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, KeyTransform):
            continue
        r = module.rotation
        same = next((k for k in kept if k.shape == r.shape and k.dtype == r.dtype and torch.equal(k, r)), None)
        if same is None:
            kept.append(r)
        else:
            module.rotation = same
        module.hadamard_scales()  # worked out now, not inside a captured step (whose torch ops would break it)
    return len(kept)

