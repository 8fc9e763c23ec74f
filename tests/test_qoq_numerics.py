"""Invariants and error bounds of the QoQ reference numerics (kernels/qoq_ref.py).

Bounds asserted (fp32 slack aside):
- level 1 (unclipped): |w/s1| <= 119, i.e. the protective range is never clamped.
- level 2: s2 in 1..16, z in 0..15, s2*(u-z) in [-128, 127] for all 16 codes,
  |q1 - s2*(u-z)| <= s2/2 (exhaustive over every group range).
- group W4 (unclipped):   |w - deq| <= s1*(s2 + 1)/2  (= s1/2 level 1 + s1*s2/2 level 2).
- channel W4 (unclipped): |w - deq| <= s1/2.
- activations: |x - s_a*x_q| <= s_a/2.
- KV4: |x - deq| <= scale/2 + 2^-10*amax (fp16 scale/zero) [+ 2^-11*|x| fp16 output].
"""
import pytest
import torch

from qoqserve.kernels import kv_ref as KV
from qoqserve.kernels import qoq_ref as Q
from qoqserve.quant.weight_quantizer import WeightQuantizer

EPS = 1e-5


def adversarial_weights(k=128, g=None):
    torch.manual_seed(0)
    rows = [torch.randn(k), torch.randn(k) * 3 + 1]
    rows.append(torch.full((k,), 0.37))                     # constant
    rows.append(-torch.full((k,), 2.5))                     # constant negative
    rows.append(torch.zeros(k))                             # all zero
    one = torch.randn(k) * 0.01
    one[5] = 40.0
    rows.append(one)                                         # one outlier
    neg = -torch.rand(k) - 1
    rows.append(neg)                                         # one-sided
    rows.append(torch.randn(k) * 1e-7)                      # tiny (subnormal s1)
    rows.append(torch.randn(k) * 1e-30)                     # below fp16 entirely
    rows.append(torch.randn(k) * 1e4)                       # large
    spike = torch.zeros(k)
    spike[0], spike[-1] = 119.0, -119.0                      # exact protective edges
    rows.append(spike)
    alt = torch.tensor([119.0, -119.0]).repeat(k // 2)
    rows.append(alt)                                         # full +-range every group
    return torch.stack(rows + list(torch.randn(20, k) * torch.rand(20, 1) * 5))


def test_pack_roundtrip_and_errors():
    u = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    p = Q.pack_uint4(u)
    assert p.shape == (7, 5) and p.dtype == torch.uint8
    assert torch.equal(p[0, 0], (u[0, 0] | (u[0, 1] << 4)))
    assert torch.equal(Q.unpack_uint4(p), u)
    kv = torch.randint(0, 16, (3, 2, 8), dtype=torch.uint8)
    assert torch.equal(Q.unpack_uint4(KV.pack_kv4(kv)), kv)
    with pytest.raises(ValueError, match="even"):
        Q.pack_uint4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        Q.pack_uint4(torch.full((2, 2), 16, dtype=torch.uint8))


def test_level2_exhaustive_over_all_group_ranges():
    lo = torch.arange(-119, 1).float()
    hi = torch.arange(0, 120).float()
    L, H = (t.flatten() for t in torch.meshgrid(lo, hi, indexing="ij"))
    vals = torch.arange(-119, 120).float()
    inside = (vals >= L[:, None]) & (vals <= H[:, None])
    q1 = torch.cat([torch.where(inside, vals, L[:, None]), H[:, None]], dim=1)
    s2, z, u = Q.level2_params(q1)
    assert s2.min() >= 1 and s2.max() <= 16 and (s2 * 15).max() <= 255
    assert z.min() >= 0 and z.max() <= 15
    assert ((q1 - s2[:, None] * (u - z[:, None])).abs() <= s2[:, None] / 2).all()
    every_code = s2[:, None] * (torch.arange(16.0) - z[:, None])
    assert every_code.min() >= -128 and every_code.max() <= 127


@pytest.mark.parametrize("g", [32, 64, 128])
def test_group_invariants_and_bound(g):
    w = adversarial_weights(128)
    q = Q.quantize_weight_group(w, g)
    n, k = w.shape
    assert q.s1.dtype == torch.float16 and (q.s1 > 0).all() and torch.isfinite(q.s1).all()
    assert q.s2.shape == q.z.shape == (n, k // g) and q.u.shape == (n, k)
    assert all(t.dtype == torch.uint8 for t in (q.s2, q.z, q.u))
    s1 = q.s1.float()[:, None]
    assert ((w / s1).abs() <= Q.PROTECT + EPS).all()       # protective range, no clamping
    assert q.s2.min() >= 1 and q.s2.max() <= 16 and q.z.max() <= 15 and q.u.max() <= 15
    every = q.s2.float()[..., None] * (torch.arange(16.0) - q.z.float()[..., None])
    assert every.min() >= -128 and every.max() <= 127
    w8 = Q.group_weight_to_int8(q)
    ref = (q.u.view(n, -1, g).float() - q.z.float()[..., None]) * q.s2.float()[..., None]
    assert torch.equal(w8.float(), ref.view(n, k))
    deq = Q.group_weight_to_float(q)
    s2 = q.s2.float().repeat_interleave(g, dim=1)
    bound = s1 * (s2 + 1) / 2
    assert ((w - deq).abs() <= bound * (1 + EPS) + 1e-30).all()
    # the stored fp16 s1 is the one that produced the codes
    for c in range(0, k, g):
        s2c, zc, uc = Q.quantize_group_columns(w[:, c:c + g], q.s1)
        assert torch.equal(s2c, q.s2[:, c // g]) and torch.equal(zc, q.z[:, c // g])
        assert torch.equal(uc, q.u[:, c:c + g])


def test_group_clip_and_errors():
    w = adversarial_weights(128)
    q = Q.quantize_weight_group(w, 64, clip=torch.full((w.shape[0],), 0.5))
    full = Q.quantize_weight_group(w, 64)
    big = full.s1.float() > 1e-6
    assert (q.s1.float()[big] < full.s1.float()[big]).all()
    assert q.u.max() <= 15 and q.s2.max() <= 16
    with pytest.raises(ValueError, match="multiple"):
        Q.quantize_weight_group(torch.randn(4, 96), 64)


def test_channel_invariants_and_bound():
    w = adversarial_weights(96)
    q = Q.quantize_weight_channel(w)
    assert q.s1.dtype == torch.float16 and (q.s1 > 0).all()
    assert q.z.dtype == q.u.dtype == torch.uint8 and q.z.max() <= 15 and q.u.max() <= 15
    deq = Q.channel_weight_to_float(q)
    assert ((w - deq).abs() <= q.s1.float()[:, None] / 2 * (1 + EPS) + 1e-30).all()
    assert (deq[4] == 0).all()                              # all-zero row stays exact
    qc = Q.quantize_weight_channel(w, clip=0.6)
    assert qc.u.max() <= 15 and (qc.s1.float() <= q.s1.float()).all()


@pytest.mark.parametrize("g", [0, 64])
def test_weight_quantizer_column_path_matches_rtn(g):
    w = adversarial_weights(128)
    wq = WeightQuantizer(w, g)
    cols = []
    for c in range(w.shape[1]):
        if g and c % g == 0:
            wq.prepare_group(c, w[:, c:c + g])
        cols.append(wq.quant_dequant(c, w[:, c]))
    res = wq.result()
    if g:
        ref = Q.quantize_weight_group(w, g)
        assert torch.equal(res.s2, ref.s2) and torch.equal(res.z, ref.z)
        deq = Q.group_weight_to_float(res)
    else:
        ref = Q.quantize_weight_channel(w)
        assert torch.equal(res.z, ref.z)
        deq = Q.channel_weight_to_float(res)
    assert torch.equal(res.s1, ref.s1) and torch.equal(res.u, ref.u)
    assert torch.equal(torch.stack(cols, 1), deq)


@pytest.mark.parametrize("g,searched", [(0, False), (64, False), (64, True)])
def test_quantize_all_is_the_column_path_in_one_pass(g, searched):
    from qoqserve.quant.group_search import search_group_params

    w = adversarial_weights(128) * torch.linspace(0.5, 3.0, 128)  # rows of different ranges
    params = (lambda x, col: search_group_params(x)) if searched else None
    by_column = WeightQuantizer(w, g, group_params=params)
    for c in range(w.shape[1]):
        if g and c % g == 0:
            by_column.prepare_group(c, w[:, c:c + g])
        by_column.quant_dequant(c, w[:, c])
    one_pass = WeightQuantizer(w, g, group_params=params).quantize_all(w)
    assert torch.equal(one_pass.u, by_column.u) and torch.equal(one_pass.s1, by_column.s1)
    assert torch.equal(one_pass.z, by_column.result().z)
    assert one_pass.u.float().std() > 1  # not a degenerate all-equal code matrix


def test_activation_quant():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 64) * torch.rand(5, 3, 1) * 10
    x[0, 0] = 0
    x_q, s = Q.quantize_act_int8(x)
    assert x_q.dtype == torch.int8 and s.shape == (5, 3) and s.dtype == torch.float32
    assert x_q.abs().max() <= 127 and s[0, 0] == 1 and (x_q[0, 0] == 0).all()
    assert ((x - s[..., None] * x_q.float()).abs() <= s[..., None] / 2 * (1 + EPS)).all()
    assert (x_q[1:].abs().amax(-1) == 127).all()
    assert torch.allclose(Q.act_row_sum(x), x.sum(-1))


def test_kv4_bounds():
    torch.manual_seed(2)
    x = torch.randn(9, 4, 64) * torch.rand(9, 4, 1) * 8
    x[0, 0] = 0.0                                             # all zero head
    x[0, 1] = 3.0                                             # constant head
    x[1, 0] = 1000.0 + torch.randn(64) * 1e-3                 # big offset, tiny spread
    x[1, 1] = torch.randn(64) * 1e-6                          # tiny
    x[1, 2, 7] = 50.0                                         # outlier
    x = x.half().float()  # K/V arrive in fp16
    codes, scale, zero = KV.quantize_kv4(x)
    assert codes.dtype == torch.uint8 and codes.max() <= 15 and codes.shape == x.shape
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (9, 4)
    assert torch.isfinite(zero).all() and (scale > 0).all()
    amax = x.abs().amax(-1, keepdim=True)
    bound = scale.float()[..., None] / 2 + amax * 2**-10
    assert ((x - KV.dequantize_kv4(codes, scale, zero, torch.float32)).abs() <= bound).all()
    deq16 = KV.dequantize_kv4(codes, scale, zero)
    assert deq16.dtype == torch.float16
    assert ((x - deq16.float()).abs() <= bound + x.abs() * 2**-11).all()
    assert (KV.dequantize_kv4(codes, scale, zero)[0, 0] == 0).all()


def _gemm_operands(m, k=256, n=48, seed=3):
    torch.manual_seed(seed)
    x = torch.randn(m, k) * 2
    w = torch.randn(n, k) * 0.05
    return x, w


@pytest.mark.parametrize("m", [1, 3, 17, 33])
def test_group_gemm_int_vs_sim_vs_dequant(m):
    x, w = _gemm_operands(m)
    q = Q.quantize_weight_group(w, 64)
    w8 = Q.group_weight_to_int8(q)
    y = Q.w4a8_group_linear(x, w8, q.s1)
    y_sim = Q.w4a8_group_linear_sim(x, w8, q.s1)
    assert y.shape == (m, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y, y_sim, rtol=1e-6, atol=1e-6 * y.abs().max().item())
    x_q, s_a = Q.quantize_act_int8(x)
    ref = (s_a[:, None] * x_q.double()) @ Q.group_weight_to_float(q).double().t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    y3 = Q.w4a8_group_linear(x.view(1, m, -1), w8, q.s1)      # leading dims pass through
    assert torch.equal(y3[0], y)
    full = x @ w.t()                                           # sanity: close to fp32 layer
    assert (y - full).norm() < 0.2 * full.norm()  # ~10% is W4 g64 on Gaussian rows


@pytest.mark.parametrize("m", [1, 3, 17, 33])
def test_channel_gemm_int_vs_sim_vs_dequant(m):
    x, w = _gemm_operands(m)
    x = x + 0.5  # nonzero row sums exercise the zero-point epilogue
    q = Q.quantize_weight_channel(w)
    y = Q.w4a8_channel_linear(x, q.u, q.s1, q.z)
    y_sim = Q.w4a8_channel_linear_sim(x, q.u, q.s1, q.z)
    torch.testing.assert_close(y, y_sim, rtol=1e-6, atol=1e-6 * y.abs().max().item())
    # exact value of the epilogue: first term uses quantized x, zero term the raw row sum
    x_q, s_a = Q.quantize_act_int8(x)
    s1 = q.s1.double()
    ref = (s_a.double()[:, None] * (x_q.double() @ q.u.double().t()) * s1
           - x.double().sum(1, keepdim=True) * (q.z.double() * s1))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    full = x @ w.t()
    assert (y - full).norm() < 0.25 * full.norm()


def test_int8_mm_never_wraps_and_padding():
    torch.manual_seed(4)
    k = 8192  # 127*127*8192 ~ 1.3e8: beyond int16/fp32-exact, well inside int32
    a = torch.randint(120, 128, (17, k), dtype=torch.int8)
    a[::2] *= -1
    b = torch.randint(-128, -120, (9, k), dtype=torch.int8)
    exact = a.long() @ b.long().t()
    assert exact.abs().max() > 2**24
    out = Q.int8_mm(a, b)
    assert out.dtype == torch.int32 and torch.equal(out.long(), exact)
    for m, kk, n in [(1, 8192, 9), (3, 13, 5), (33, 64, 7)]:
        aa, bb = a[:m, :kk].contiguous(), b[:n, :kk].contiguous()
        ref = aa.long() @ bb.long().t()
        assert torch.equal(Q.int8_mm(aa, bb).long(), ref)
        assert torch.equal(Q.int8_mm(aa, bb, _pad_like_cuda=True).long(), ref)
    # worst case at the largest K allowed: every product is (-128)*(-128)
    kmax = Q.INT8_MM_MAX_K
    big = torch.full((1, kmax), -128, dtype=torch.int8)
    assert Q.int8_mm(big, big).item() == kmax * 128 * 128
    with pytest.raises(ValueError, match="overflow"):
        Q.int8_mm(torch.zeros(1, kmax + 1, dtype=torch.int8), torch.zeros(1, kmax + 1, dtype=torch.int8))


def test_exact_fp32_int_mm_equals_integer_sums():
    # the route for CPUs whose torch has no INT8 GEMM kernel: fp32 GEMMs over
    # K slices, each exact; worst-case magnitudes at and past a slice boundary
    torch.manual_seed(5)
    kmax = Q.INT8_MM_MAX_K
    big = torch.full((2, kmax), -128, dtype=torch.int8)
    assert Q.exact_fp32_int_mm(big, big).eq(kmax * 128 * 128).all()
    for m, k, n in [(1, 1, 1), (5, Q.FP32_EXACT_K, 7), (3, Q.FP32_EXACT_K + 1, 4), (17, 3000, 33)]:
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        a[0] = -128
        b = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        b[0] = -128
        ref = a.long() @ b.long().t()
        out = Q.exact_fp32_int_mm(a, b)
        assert out.dtype == torch.int32 and torch.equal(out.long(), ref)
    codes = torch.randint(0, 16, (6, 1536), dtype=torch.uint8)
    x = torch.randint(-127, 128, (4, 1536), dtype=torch.int8)
    assert torch.equal(Q.exact_fp32_int_mm(x, codes).long(), x.long() @ codes.long().t())
    assert Q.exact_fp32_int_mm(x[:, :0], codes[:, :0]).eq(0).all()


def test_int8_mm_takes_the_fp32_route_without_an_int8_kernel(monkeypatch):
    monkeypatch.setattr(Q, "cpu_has_int8_gemm", lambda: False)
    monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("_int_mm called"))
    a = torch.randint(-127, 128, (9, 2100), dtype=torch.int8)
    b = torch.randint(-128, 128, (11, 2100), dtype=torch.int8)
    assert torch.equal(Q.int8_mm(a, b).long(), a.long() @ b.long().t())


def test_gemm_with_extreme_int8_values():
    # saturated activations (+-127) times the largest level-2 weights over a long K:
    # |acc| ~ 5.8e7, far beyond exact fp32 integers, must come out exact
    k = 4096
    x = torch.where(torch.arange(k) % 2 == 0, 5.0, -5.0).repeat(3, 1)
    w = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(16, 1)
    q = Q.quantize_weight_group(w, 128)
    w8 = Q.group_weight_to_int8(q)
    assert w8.abs().min() == 112  # s2 = 16 forces z = 8: +-119 -> +-112
    x_q, s_a = Q.quantize_act_int8(x)
    assert x_q.abs().min() == 127
    y = Q.w4a8_group_linear(x, w8, q.s1)
    acc = x_q.long() @ w8.long().t()
    assert acc.abs().max() > 2**24
    ref = acc.double() * s_a.double()[:, None] * q.s1.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=0)
