"""GPTQ and clip-ratio search on synthetic layers with correlated inputs."""
import pytest
import torch

from qoqserve.kernels import qoq_ref as Q
from qoqserve.quant.clip import DEFAULT_GRID, search_clip_ratios
from qoqserve.quant.gptq import CrossAccumulator, HessianAccumulator, asymmetric_target, gptq_quantize, gram
from qoqserve.quant.weight_quantizer import WeightQuantizer


def correlated_layer(n=64, k=256, t=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, 48, generator=g)
    a = torch.randn(48, k, generator=g)
    x = z @ a + 0.1 * torch.randn(t, k, generator=g)   # low-rank + noise: strongly correlated
    x[:, :4] *= 8                                         # a few loud input channels
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, [3, k // 2, k - 5]] *= 12                             # outlier weight columns
    return w, x


def hessian_of(x, chunks=4):
    acc = HessianAccumulator(x.shape[1])
    for part in x.chunk(chunks):
        acc.add(part)
    return acc.hessian()


def out_err(x, w, wq):
    return (x @ w.t() - x @ wq.t()).norm().item()


def rtn(w, g):
    if g:
        return Q.group_weight_to_float(Q.quantize_weight_group(w, g))
    return Q.channel_weight_to_float(Q.quantize_weight_channel(w))


def check_format(res, g):
    assert res.u.dtype == torch.uint8 and res.u.max() <= 15 and res.z.max() <= 15
    assert res.s1.dtype == torch.float16 and (res.s1 > 0).all()
    if g:
        assert res.s2.min() >= 1 and res.s2.max() <= 16
        every = res.s2.float()[..., None] * (torch.arange(16.0) - res.z.float()[..., None])
        assert every.min() >= -128 and every.max() <= 127
        return Q.group_weight_to_float(res)
    return Q.channel_weight_to_float(res)


def test_hessian_accumulator():
    x = torch.randn(300, 16)
    h = hessian_of(x, chunks=7)
    torch.testing.assert_close(h, 2 / 300 * x.t() @ x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        HessianAccumulator(4).hessian()


@pytest.mark.parametrize("g,act_order", [(64, False), (0, False), (64, True), (0, True)])
def test_gptq_beats_rtn(g, act_order):
    w, x = correlated_layer()
    res, wq = gptq_quantize(w, hessian_of(x), WeightQuantizer(w, g), act_order=act_order)
    deq = check_format(res, g)
    assert torch.equal(deq, wq)                    # returned weights are exactly the codes'
    e_gptq, e_rtn = out_err(x, w, wq), out_err(x, w, rtn(w, g))
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)


def test_gptq_identity_hessian_is_rtn_and_dead_columns():
    w, _ = correlated_layer(n=16, k=128)
    res, wq = gptq_quantize(w, torch.eye(128), WeightQuantizer(w, 64), percdamp=0.0,
                            block_size=32)
    ref = Q.quantize_weight_group(w, 64)
    assert torch.equal(res.u, ref.u) and torch.equal(res.s2, ref.s2)
    h = torch.eye(128)
    h[5, 5] = h[70, 70] = 0                         # inputs that never fire
    _, wq = gptq_quantize(w, h, WeightQuantizer(w, 0))
    assert (wq[:, [5, 70]] == 0).all()


def test_gptq_rejects_bad_hessian_shape():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError):
        gptq_quantize(w, torch.eye(32), WeightQuantizer(w, 0))


def _row_out_err(x, w, deq):
    return ((w - deq) @ x.t()).square().sum(1)


@pytest.mark.parametrize("mode", ["channel", "g64"])
@pytest.mark.parametrize("t", [64, 512])  # T < K (direct) and T > K (Gram) paths
def test_clip_search(mode, t):
    torch.manual_seed(5)
    k = 128
    w = torch.randn(40, k) * 0.05
    w[:8, 7] = 5.0                                 # rows with one huge outlier weight ...
    x = torch.randn(t, k)
    x[:, 7] *= 0.01                                # ... on a quiet input: clipping it is cheap
    if mode == "channel":
        def fn(wr, r):
            return Q.channel_weight_to_float(Q.quantize_weight_channel(wr, r))
    else:
        def fn(wr, r):
            return Q.group_weight_to_float(Q.quantize_weight_group(wr, 64, r))
    ratios = search_clip_ratios(w, x, fn, max_chunk_bytes=64 << 10)  # forces chunking
    assert ratios.shape == (40,) and ratios.dtype == torch.float32
    assert all(any(abs(r - c) < 1e-6 for c in DEFAULT_GRID) for r in ratios.tolist())
    e_best = _row_out_err(x, w, fn(w, ratios))
    e_one = _row_out_err(x, w, fn(w, torch.ones(40)))
    assert (e_best <= e_one * (1 + 1e-4)).all()
    assert (ratios[:8] < 1).all()
    assert e_best[:8].sum() < 0.9 * e_one[:8].sum()


def test_gram_from_the_upper_triangle_is_the_full_product():
    """gram() computes x^T x from row panels of its upper triangle: the same
    fp32 numbers as the full product, exactly symmetric."""
    g = torch.Generator().manual_seed(2)
    for k in (100, 576, 1000):  # below one panel, whole panels, a ragged last panel
        x = torch.randn(700, k, generator=g)
        h = gram(x)
        torch.testing.assert_close(h, x.t() @ x, rtol=1e-6, atol=1e-4)
        assert torch.equal(h, h.t())



def test_cross_accumulator_and_asymmetric_target():
    """W* is the least-squares weight mapping the quantized model's inputs x to
    the FP model's outputs y W^T (up to GPTQ's damping), and W itself when the
    two streams agree."""
    w, y = correlated_layer(t=4096)
    g = torch.Generator().manual_seed(1)
    x = y + 0.3 * torch.randn(y.shape, generator=g) * y.std(0)  # the quantized stream: y plus drift
    acc, cross = HessianAccumulator(x.shape[1]), CrossAccumulator(x.shape[1])
    for xs, ys in zip(x.chunk(5), y.chunk(5)):
        acc.add(xs)
        cross.add_pair(ys, xs)
    torch.testing.assert_close(cross.hessian(), 2 / x.shape[0] * y.t() @ x, rtol=1e-5, atol=1e-4)
    h = acc.hessian()
    target = asymmetric_target(w, h, cross.hessian(), percdamp=1e-6)  # the whole way (alpha 1)
    exact = torch.linalg.lstsq(x.double(), (y @ w.t()).double()).solution.t().float()
    assert (target - exact).abs().max() <= 1e-3 * exact.abs().max()
    # it fits the FP outputs far better than W does on the drifted inputs
    fp_out = y @ w.t()
    assert (x @ target.t() - fp_out).norm() < 0.7 * (x @ w.t() - fp_out).norm()
    # no drift: W comes back exactly, whatever the damping
    torch.testing.assert_close(asymmetric_target(w, h, h, percdamp=0.01), w)
    # alpha takes that share of the correction
    half = asymmetric_target(w, h, cross.hessian(), alpha=0.5, percdamp=1e-6)
    torch.testing.assert_close(half, (w + target) / 2, rtol=1e-4, atol=1e-5)
