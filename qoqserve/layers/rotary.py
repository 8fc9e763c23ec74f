"""Rotary position embedding (half-split layout, as in HF Llama/Qwen2), over
all of a head's channels or, for partial rotary embeddings (Phi-4-mini), its
first rotary_dim (the rest pass unturned)."""
from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, theta: float, head_dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): each frequency between its interpolated (1 /
    factor) and its original value, by how many turns it makes over the
    pretrained context (below beta_slow turns: interpolated; above beta_fast:
    original; a linear ramp over the channels between); and the factor by
    which cos and sin are scaled (attention_factor, else from mscale)."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

    def channel(turns: float) -> float:  # the channel whose frequency turns `turns` times over orig
        return head_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(scaling.get("beta_fast") or 32), channel(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original frequency
    mixed = inv_freq / factor * (1 - keep) + inv_freq * keep
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    return mixed, float(attention)


def _longrope(exponents: torch.Tensor, theta: float, max_positions: int,
              scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5): each frequency divided by its own
    factor, the long ones where the context served passes the pretrained one,
    else the short ones, for every position. transformers switches per
    forward pass on the longest sequence in it; vLLM and llama.cpp fix the
    choice by the context, as here, so that a sequence's tokens do not depend
    on what it or its batch grows to."""
    long = max_positions > scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32,
                           device=exponents.device)
    return 1.0 / (factors * theta ** exponents), scaling["attention_factor"]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim = rotary_dim or head_dim
        # The table is computed on the CPU whatever the ambient device: the same
        # values on every device, and on "meta" (shape-only builds) arange and
        # pow would load torch's Python reference ops, seconds of start-up.
        device = torch.empty(0).device
        cpu = torch.device("cpu")
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=cpu).float() / rotary_dim
        inv_freq = 1.0 / (theta ** exponents)
        attention = 1.0  # YaRN and LongRoPE scale cos and sin
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type"))
            if rtype == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif rtype == "linear":
                inv_freq = inv_freq / scaling["factor"]
            elif rtype == "yarn":
                inv_freq, attention = _yarn(inv_freq, theta, rotary_dim, scaling)
            elif rtype == "longrope":
                inv_freq, attention = _longrope(exponents, theta, max_positions, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32, device=cpu)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        # Kept in fp32; cast per call to the activation dtype as HF does.
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In fp32, rounded once: torch's bf16 elementwise kernels round differently
    # depending on the tensor's shape (a 1-token chunk differed from the same
    # token in a longer one), which would make outputs depend on prefill chunking.
    rot = cos.shape[-1]
    xf = x.float()
    xr = xf[..., :rot]
    half = rot // 2
    turned = xr * cos + torch.cat([-xr[..., half:], xr[..., :half]], dim=-1) * sin
    if rot < x.shape[-1]:  # partial rotary: the other channels pass
        turned = torch.cat([turned, xf[..., rot:]], dim=-1)
    return turned.to(x.dtype)
