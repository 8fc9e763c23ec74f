"""Causal fp64 attention over dense fp32 q/k/v (kernels/cpu/dense_attention_f64.c),
the CPU path of PagedAttention._sdpa: against torch's fp64 SDPA."""
import pytest
import torch
import torch.nn.functional as F

from qoqserve.kernels.cpu import dense_attention_f64 as K

pytestmark = pytest.mark.skipif(K.vector_path() is None, reason="needs AVX2 (or AVX-512) and a C compiler")
BEST = K.vector_path()


@pytest.fixture(params=["avx512", "avx2"])
def path(request, monkeypatch):
    """Each vector path this CPU has: the AVX-512 one, and the AVX2 one (taken
    on AVX-512 CPUs only under QOQSERVE_CPU_ISA=avx2)."""
    if request.param == "avx512" and BEST != "avx512":
        pytest.skip("no AVX-512 on this CPU")
    if request.param == "avx2":
        monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx2")
    assert K.vector_path() == request.param
    return request.param


def _fp64_sdpa(q, k, v, offset, scale):
    qh, kh, vh = (t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=offset)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _inputs(lq, offset, h, hkv, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(lq, h, d, generator=gen) * 3
    k = torch.randn(offset + lq, hkv, d, generator=gen) * 3
    v = torch.randn(offset + lq, hkv, d, generator=gen)
    return q, k, v


@pytest.mark.parametrize("lq,offset,h,hkv,d", [(512, 0, 9, 3, 64), (37, 0, 4, 4, 128), (100, 29, 6, 2, 64),
                                               (1, 40, 9, 3, 64), (9, 0, 2, 1, 8), (70, 3, 8, 2, 96)])
def test_matches_fp64_sdpa_to_the_rounding_of_its_fp32_output(lq, offset, h, hkv, d, path):
    q, k, v = _inputs(lq, offset, h, hkv, d)
    assert K.handles(q, k, v, offset)
    out = K.attention(q, k, v, offset, d ** -0.5)
    ref = _fp64_sdpa(q, k, v, offset, d ** -0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    # fp32 rounding of an fp64 result (half an fp32 ulp) plus fp64-level error
    bound = ref.abs() * (2.0 ** -24 + 1e-13) + 1e-30
    assert ((out.double() - ref).abs() <= bound).all()


def test_a_row_depends_only_on_its_position_and_keys(path):
    """The prompt whole, or its last 23 queries over the first 41 keys as a cached
    prefix: the same bits for those rows (and for any split)."""
    q, k, v = _inputs(64, 0, 9, 3, 64, seed=1)
    whole = K.attention(q, k, v, 0, 0.125)
    for start in (41, 63, 1):
        part = K.attention(q[start:], k, v, start, 0.125)
        assert torch.equal(part, whole[start:])


@pytest.mark.skipif(BEST != "avx512", reason="one vector path only on this CPU")
@pytest.mark.parametrize("lq,offset,h,hkv,d", [(300, 0, 9, 3, 64), (37, 11, 4, 4, 128), (9, 0, 2, 1, 8)])
def test_the_avx2_path_gives_the_avx512_paths_bits(lq, offset, h, hkv, d, monkeypatch):
    q, k, v = _inputs(lq, offset, h, hkv, d, seed=3)
    q[:, 0] *= 40  # scores far apart: exp underflows to subnormals and to 0
    wide = K.attention(q, k, v, offset, d ** -0.5)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx2")
    assert torch.equal(K.attention(q, k, v, offset, d ** -0.5), wide)


def test_attention_layer_agrees_with_the_torch_path(monkeypatch, path):
    from qoqserve.layers.attention import PagedAttention
    from qoqserve.layers.attention_backends import AttentionBackend
    from qoqserve.layers.kv_cache import DenseKVCacheLayout
    layer = PagedAttention(9, 3, 64, AttentionBackend(DenseKVCacheLayout(3, 64, 16, torch.float32)))
    q, k, v = _inputs(200, 0, 9, 3, 64, seed=2)
    fast = layer._sdpa(q, k, v, 0)
    monkeypatch.setattr(K, "handles", lambda *a: False)
    slow = layer._sdpa(q, k, v, 0)
    assert (fast != slow).float().mean() < 1e-4  # only fp64 values within their last bits of an fp32 boundary
    torch.testing.assert_close(fast, slow, rtol=1.2e-7, atol=1e-30)


def test_what_it_does_not_take_goes_to_torch(monkeypatch):
    q, k, v = _inputs(16, 0, 4, 2, 64)
    assert not K.handles(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0)
    assert not K.handles(q[..., :60], k[..., :60], v[..., :60], 0)  # head_dim not a multiple of 8
    assert not K.handles(q, k[:10], v[:10], 0)                    # keys must be offset + queries
    qg = q.clone().requires_grad_()
    assert not K.handles(qg, k, v, 0)  # it has no backward: autograd keeps torch's SDPA
    with torch.no_grad():
        assert K.handles(qg, k, v, 0)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "scalar")
    assert not K.handles(q, k, v, 0)
