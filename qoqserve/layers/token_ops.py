"""The per-token ops between a decoder layer's GEMMs and attention, as one
swappable object (like the attention and linear backends): embedding lookup,
RMSNorm (optionally fused with the residual add before it), q/k/v split with
RoPE and the key transform (after Qwen3's per-head q/k norms), SiLU * mul;
and the final logits' soft-capping (Gemma 2).

* `TorchTokenOps`: torch ops (any device and dtype);
* `CpuTokenOps`: one C call per op (kernels/cpu/elementwise.c) where torch
  runs 3-12 small ops, and a call a captured CPU step can replay
  (kernels/cpu/graph.py). fp32/bf16 activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qoqserve.kernels.cpu import elementwise


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order: Gemma 2's soft-capping of
    attention scores and of the final logits."""
    return torch.tanh(x / cap) * cap


class TorchTokenOps:
    name = "torch"

    def embed(self, ids: torch.Tensor, table: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """table[ids], times scale where given (Gemma's embeddings), in the table's dtype."""
        out = F.embedding(ids, table)
        return out if scale is None else out * torch.tensor(scale, dtype=table.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # statistics in fp32 whatever the activation dtype, as in HF Llama
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(h + delta), h + delta)."""
        h = h + delta
        return self.rms_norm(h, weight, eps), h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (Gemma's GeGLU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        """soft_cap of the final logits (Gemma 2's final_logit_softcapping)."""
        return soft_cap(logits, cap)

    def qkv_rope(self, qkv: torch.Tensor, positions: torch.Tensor, rope, key_transform,
                 num_heads: int, num_kv_heads: int, head_dim: int, qk_norm=None):
        """qkv [T, (H + 2 Hkv) D] -> q [T, H, D], k, v [T, Hkv, D] after RoPE
        (and the key transform when there is one); qk_norm: the (q, k) RMSNorms
        over each head before RoPE, or None; rope None: a layer without RoPE."""
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        t = positions.shape[0]
        q = q.reshape(t, num_heads, head_dim)
        k = k.reshape(t, num_kv_heads, head_dim)
        v = v.reshape(t, num_kv_heads, head_dim)
        if qk_norm is not None:
            q, k = (TorchTokenOps.rms_norm(self, x, n.weight, n.eps) for x, n in zip((q, k), qk_norm))
        if rope is not None:
            q, k = rope(positions, q, k)
        if key_transform is not None:
            q, k = key_transform(q, k)
        return q, k, v


class CpuTokenOps(TorchTokenOps):
    name = "c"

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return elementwise.available() and dtype in elementwise.DTYPES

    def embed(self, ids, table, scale=None):
        return elementwise.embed(ids, table, scale)

    def rms_norm(self, x, weight, eps):
        return elementwise.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps):
        return elementwise.add_rms_norm(h, delta, weight, eps)

    def silu_mul(self, gate_up):
        return elementwise.silu_mul(gate_up)

    def gelu_mul(self, gate_up):
        return elementwise.gelu_mul(gate_up)

    def softcap(self, logits, cap):
        if logits.dtype == torch.float32 and logits.dim() == 2:
            return elementwise.softcap(logits, cap)
        return super().softcap(logits, cap)

    def qkv_rope(self, qkv, positions, rope, key_transform, num_heads, num_kv_heads, head_dim, qk_norm=None):
        kt = key_transform
        norms = {} if qk_norm is None else dict(q_norm=qk_norm[0].weight, k_norm=qk_norm[1].weight,
                                                  eps=qk_norm[0].eps)
        cos, sin = (None, None) if rope is None else (rope.cos, rope.sin)
        if kt is None:
            return elementwise.qkv_rope(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, **norms)
        scales = kt.hadamard_scales()  # a signed Hadamard R: the fast transform
        return elementwise.qkv_rope(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim,
                                    kt.shift, kt.rotation if scales is None else scales, scales is not None, **norms)
