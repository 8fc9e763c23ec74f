"""Fill in a layer's KeyTransform (qoqserve/layers/key_transform.py) from calibration."""
from __future__ import annotations

import torch

from qoqserve.quant.hadamard import orthogonal_matrix


def key_rotation(head_dim: int, seed: int | None = 0) -> torch.Tensor:
    """The per-head R: a signed Hadamard / sqrt(D), or random orthogonal (float64)."""
    return orthogonal_matrix(head_dim, seed)


@torch.no_grad()
def center_and_rotate_keys(layer, key_mean: torch.Tensor, smooth_lambda: torch.Tensor | None = None,
                           seed: int | None = 0) -> None:
    """shift = the mean post-RoPE key ([Hkv, D], measured before SmoothAttention,
    hence divided by its lambda when one was applied); rotation = a signed
    Hadamard / sqrt(D) (a random orthogonal matrix where no Hadamard of order D
    is known). Leaves the layer's function unchanged (see KeyTransform)."""
    kt = layer.self_attn.key_transform
    if kt is None:
        raise ValueError("the model was built without key_transform=True")
    mean = key_mean.double().to(kt.shift.device)
    if smooth_lambda is not None:
        mean = mean / smooth_lambda.to(mean.device)
    kt.shift.copy_(mean.to(kt.shift.dtype))
    d = kt.rotation.shape[0]
    kt.rotation.copy_(key_rotation(d, seed).to(kt.rotation))
