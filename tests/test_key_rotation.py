"""The key transform's signed Hadamard R applied by the CPU token ops as a fast
Walsh-Hadamard transform (key_rotation.h): which R take it, its bits against
the same butterflies in torch, and its values against torch's q R."""
from __future__ import annotations

import pytest
import torch

from qoqserve.kernels.cpu import elementwise
from qoqserve.layers.key_transform import KeyTransform, sylvester
from qoqserve.layers.rotary import RotaryEmbedding
from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
from qoqserve.quant.hadamard import hadamard_matrix, orthogonal_matrix

needs_c = pytest.mark.skipif(not elementwise.available(), reason="C token ops not built here")


def _transform(kv_heads: int, head_dim: int, dtype, rotation: torch.Tensor, seed: int = 0) -> KeyTransform:
    kt = KeyTransform(kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        kt.shift.copy_(torch.randn(kv_heads, head_dim, generator=g).to(dtype))
        kt.rotation.copy_(rotation.to(dtype))
    return kt


def test_the_shipped_signed_hadamard_is_recognised_and_nothing_else():
    for d in (8, 64, 128):
        kt = _transform(2, d, torch.float32, orthogonal_matrix(d, seed=3))  # H diag(signs) / sqrt(d)
        scales = kt.hadamard_scales()
        assert scales is not None and torch.equal(kt.rotation, sylvester(d, torch.float32) * scales)
    h = orthogonal_matrix(64, seed=3)
    flipped = h.clone()
    flipped[5, 9] = -flipped[5, 9]  # one entry off: not H diag(c)
    rows_swapped = h[[1, 0] + list(range(2, 64))]  # a Hadamard matrix, not Sylvester's order
    random = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))[0]
    for r in (flipped, rows_swapped, random, torch.eye(64)):
        assert _transform(2, 64, torch.float32, r).hadamard_scales() is None
    assert hadamard_matrix(12) is not None  # an order that is no power of two: never the fast transform
    assert _transform(1, 12, torch.float32, hadamard_matrix(12) / 12 ** 0.5).hadamard_scales() is None
    # written again (as the quantizer fills R in place): worked out again
    kt = _transform(2, 64, torch.float32, torch.eye(64))
    assert kt.hadamard_scales() is None
    with torch.no_grad():
        kt.rotation.copy_(h.float())
    assert kt.hadamard_scales() is not None


def _butterflies(y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """key_rotation.h's arithmetic in torch: stride 1 first, a + b and a - b
    in fp32, then each output times its scale."""
    t = y.clone()
    d, h = y.shape[-1], 1
    while h < d:
        v = t.view(*t.shape[:-1], d // (2 * h), 2, h)
        a, b = v[..., 0, :].clone(), v[..., 1, :].clone()
        v[..., 0, :], v[..., 1, :] = a + b, a - b
        h *= 2
    return t * scales


@needs_c
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 5, 1), (32, 4, 2), (8, 2, 2)])
def test_the_fast_transform_gives_the_butterflies_bits(head_dim, heads, kv_heads):
    # 64, 128, 32: the AVX-512 code where the CPU has it; 8: the portable loop
    kt = _transform(kv_heads, head_dim, torch.float32, orthogonal_matrix(head_dim, seed=1), seed=head_dim)
    rope = RotaryEmbedding(head_dim, 512, 1e4)
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim, generator=g)
    pos = torch.randint(0, 500, (6,), generator=g)
    ops = CpuTokenOps()
    q, k, v = ops.qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim)
    q0, k0, v0 = ops.qkv_rope(qkv, pos, rope, None, heads, kv_heads, head_dim)  # RoPE alone
    scales = kt.hadamard_scales()
    assert torch.equal(q, _butterflies(q0, scales))
    assert torch.equal(k, _butterflies(k0 - kt.shift, scales))
    assert torch.equal(v, v0)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (16, 3, 1)])
def test_the_fast_transform_matches_torch_and_the_dense_product(dtype, head_dim, heads, kv_heads):
    kt = _transform(kv_heads, head_dim, dtype, orthogonal_matrix(head_dim, seed=2), seed=7)
    rope = RotaryEmbedding(head_dim, 512, 1e4)
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 500, (5,), generator=g)
    fast = CpuTokenOps().qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim)
    ref = TorchTokenOps().qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim)
    dense = elementwise.qkv_rope(qkv, pos, rope.cos, rope.sin, heads, kv_heads, head_dim, kt.shift, kt.rotation)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b, c in zip(fast, ref, dense):
        scale = max(1.0, b.float().abs().max().item())
        assert (a.float() - b.float()).abs().max() <= tol * scale
        assert (a.float() - c.float()).abs().max() <= tol * scale
    if dtype == torch.float32:  # two arithmetics, not one path twice
        assert not torch.equal(fast[0], dense[0])
    # a row alone gives the bits it gets in the batch
    alone = CpuTokenOps().qkv_rope(qkv[3:4], pos[3:4], rope, kt, heads, kv_heads, head_dim)
    assert all(torch.equal(a, b[3:4]) for a, b in zip(alone, fast))
