"""The W4A8 GEMM on packed 4-bit weights (kernels/cpu/w4a8_gemm.c) against the
torch reference (qoq_ref) and today's fused kernel on the INT8 expansion:
bit-identical outputs for ragged shapes, every group size, per channel, both
code paths (AMX-INT8 tiles where the CPU has them, AVX-512 VNNI, AVX2 and
the scalar fallback)."""
import itertools
import pathlib
import platform
import shutil
import subprocess

import pytest
import torch
from conftest import cpu_has_avx512

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import w4a8_gemm
from qoqserve.kernels.cpu.w4a8_gemm import PackedW4A8Gemm
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, fused_int8_available, int8_linear

GROUPS = (0, 32, 64, 128, 256)


def _checkpoint(n, k, group, seed):
    """Valid checkpoint tensors whose (s2, z) span every pair the loader accepts,
    so s2*(u - z) reaches both ends of INT8 (-128 with s2=16, z=8)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s1 = (torch.rand(n, generator=g) * 1e-2 + 1e-4).half()
    bias = torch.randn(n, generator=g).half()
    if not group:
        z = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=g)
        return dict(qweight=qoq_ref.pack_uint4(u), s1=s1, s2=None, zeros=z, bias=bias, w8=u, zref=z)
    pairs = torch.tensor([(s, z) for s in range(1, 17) for z in range(16) if -128 <= -s * z and s * (15 - z) <= 127])
    pick = pairs[torch.randint(0, len(pairs), (n, k // group), generator=g)]
    s2, z = pick[..., 0].to(torch.uint8), pick[..., 1].to(torch.uint8)
    w8 = ((u.view(n, -1, group).long() - z[..., None].long()) * s2[..., None].long()).view(n, k).to(torch.int8)
    return dict(qweight=qoq_ref.pack_uint4(u), s1=s1, s2=s2, zeros=z, bias=bias, w8=w8, zref=None)


def _input(m, k, dtype, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, : min(k, 4)] = torch.tensor([127.0, 0.5, -0.5, 1.5])[: min(k, 4)]  # ties: amax 127 -> scale 1
    if m > 2:
        x[2] = 0  # an all-zero row: scale 1, codes 0
    return x.to(dtype)


def _packed(c, group, with_bias=True, silu_pairs=False):
    return PackedW4A8Gemm(c["qweight"], c["s1"], c["s2"], c["zeros"], c["bias"] if with_bias else None, group,
                          silu_pairs=silu_pairs)


def _check(m, n, k, group, dtype, seed=0):
    c = _checkpoint(n, k, group, seed)
    x = _input(m, k, dtype, seed + 1)
    for with_bias in (False, True):
        b = c["bias"] if with_bias else None
        got = _packed(c, group, with_bias)(x)
        ref = int8_linear(x, c["w8"], c["s1"], c["zref"], b, cpu_ops=False)  # the torch reference
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, ref), (m, n, k, group, dtype, with_bias)
        if fused_int8_available():  # and the fused VNNI kernel on the INT8 expansion
            assert torch.equal(got, PackedInt8Gemm(c["w8"], c["s1"], c["zref"], b)(x))


def _cpu_flags() -> set:
    return set(open("/proc/cpuinfo").read().split())


def cpu_has_amx() -> bool:
    return {"amx_tile", "amx_int8"} <= _cpu_flags()


def best_isa_of_this_cpu() -> str:
    """From /proc/cpuinfo, apart from the kernel's own probe."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "amx" if cpu_has_amx() else "avx512-vnni"
    return "avx2" if "avx2" in flags else "scalar"


def _need(isa):
    if w4a8_gemm.ISAS.index(isa) > w4a8_gemm.ISAS.index(best_isa_of_this_cpu()):
        pytest.skip(f"this CPU lacks the {isa} path")


def test_the_best_path_of_this_cpu_is_taken():
    assert w4a8_gemm.available()
    assert w4a8_gemm.isa() == best_isa_of_this_cpu()  # no silent fallback


@pytest.mark.parametrize("group", GROUPS)
def test_amx_tiles_are_bit_identical_to_the_vnni_loops(monkeypatch, group):
    """Rows from the fewest the tiles take (12, padded to a 16-row tile) up,
    past the 32 of one pass, ragged N (one and two blocks left of a 4-block
    tile), K of whole 64-byte tile rows and not (those keep the VNNI loops);
    both threads' ranges split a tile."""
    _need("amx")
    for m, n in ((12, 100), (16, 17), (17, 100), (32, 48), (33, 470), (130, 50), (64, 576)):
        for k in ((768, 1536) if group in (128, 256) else (576, 1536, 520) if group == 0 else (576, 1536)):
            c = _checkpoint(n, k, group, seed=m + n + k)
            x = _input(m, k, torch.bfloat16, seed=m)
            monkeypatch.setenv(w4a8_gemm.ISA_ENV, "amx")
            got = _packed(c, group)(x)
            monkeypatch.setenv(w4a8_gemm.ISA_ENV, "avx512-vnni")
            want = _packed(c, group)(x)
            assert torch.equal(got, want), (m, n, k, group)
            assert torch.equal(got, int8_linear(x, c["w8"], c["s1"], c["zref"], c["bias"], cpu_ops=False))


def test_isa_caps_and_refusals(monkeypatch):
    have = w4a8_gemm.ISAS.index(best_isa_of_this_cpu())
    for cap, level in (("scalar", 0), ("avx2", 1), ("avx512", 1)):  # caps: never above the CPU's best
        monkeypatch.setenv(w4a8_gemm.ISA_ENV, cap)
        assert w4a8_gemm.simd_level() == min(level, have)
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, "avx512-vnni")
    if have >= 2:
        assert w4a8_gemm.simd_level() == 2
    else:
        with pytest.raises(RuntimeError, match="VNNI"):
            w4a8_gemm.isa()
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, "amx")
    if cpu_has_amx():
        assert w4a8_gemm.simd_level() == 3
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            w4a8_gemm.isa()


# M across the 6-row tile and the panel reuse (>6), N across 16-channel blocks
# and the 4-block tile, K a multiple of each group; (33, 100) and (1 or 2, 470)
# are big enough for two threads, whose ranges then split a 4-block tile
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("m,n", [(1, 17), (2, 100), (7, 64), (16, 17), (33, 100), (64, 50), (130, 17),
                                 (1, 470), (2, 470)])
def test_bit_identical_for_ragged_shapes_and_every_group_size(group, m, n):
    k = 768 if group in (128, 256) else 576
    _check(m, n, k, group, torch.bfloat16, seed=m * 100 + n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", GROUPS)
def test_bit_identical_for_every_input_dtype(dtype, group):
    _check(9, 40, 512, group, dtype, seed=group)


def _near_ties(m, k, seed):
    """Rows whose quotients x / s sit on or within a few ulps of halves (k + 0.5),
    at scales s = amax / 127 whose inverse is inexact: where a multiply by 1/s
    and the reference's division round to different codes."""
    g = torch.Generator().manual_seed(seed)
    amax = (torch.rand(m, generator=g) * 5 + 0.3) * 2.0 ** torch.randint(-20, 20, (m,), generator=g)
    s = amax / 127
    half = torch.randint(-127, 127, (m, k), generator=g).float() + 0.5
    x = half * s[:, None]
    ulps = torch.randint(-3, 4, (m, k), generator=g).float()
    x = x + ulps * torch.finfo(torch.float32).eps * x.abs()
    x[:, 0] = amax  # the row's amax, hence its scale
    return x


@pytest.mark.parametrize("m", [3, 20])  # the VNNI loops; the AMX tiles where the CPU has them
def test_near_tie_quotients_round_as_the_reference_divides(m):
    """The AVX-512 row quantization multiplies by 1/s and divides only where
    a quotient lies near a half: codes must be the division's, bit for bit
    (a multiply alone gives other codes on these rows)."""
    k, n = 512, 40
    x = _near_ties(m, k, seed=m)
    s = x.abs().amax(1, keepdim=True) / 127
    assert not torch.equal(torch.round(x * (1 / s)), torch.round(x / s))  # the rows can tell them apart
    c = _checkpoint(n, k, 64, seed=m)
    ref = int8_linear(x, c["w8"], c["s1"], c["zref"], c["bias"], cpu_ops=False)
    assert torch.equal(_packed(c, 64)(x), ref)
    if fused_int8_available():  # the fused INT8 linear quantizes its rows with the same code
        assert torch.equal(PackedInt8Gemm(c["w8"], c["s1"], c["zref"], c["bias"])(x), ref)


@pytest.mark.parametrize("k", [1536, 576, 10, 6, 2])  # per channel K is only even: padded to 8
def test_per_channel_any_even_k(k):
    _check(7, 33, k, 0, torch.float32, seed=k)


@pytest.mark.parametrize("m", [1, 2, 5])  # 1-2 rows: the raw-code dot products, scaled per group
@pytest.mark.parametrize("group", [8, 48, 1536])  # any multiple of 8 that divides K
def test_other_group_sizes_the_layout_allows(group, m):
    _check(m, 20, 1536, group, torch.float32, seed=group + m)


@pytest.mark.parametrize("m", [1, 2, 13])
@pytest.mark.parametrize("group", [0, 64])
def test_int32_accumulator_is_the_exact_integer(group, m):
    """Integer x with max |x| = 127 has s_a = 1 and s1 = 1: y is the accumulator itself."""
    n, k = 48, 576
    c = _checkpoint(n, k, group, seed=7)
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(8)).float()
    x[:, 0] = 127
    mod = PackedW4A8Gemm(c["qweight"], torch.ones(n).half(), c["s2"], c["zeros"], None, group)
    if group == 0:
        mod.zs1.zero_()  # leave the zero point out: y = x_q . u
    acc = qoq_ref.int8_mm(x.to(torch.int8), c["w8"].view(torch.int8) if group == 0 else c["w8"])
    assert torch.equal(mod(x), acc.float())


@pytest.mark.parametrize("group", [0, 32, 64, 256])
def test_the_largest_sums_do_not_saturate(group):
    """Every code 15 and x_q = +-127: the AVX2 loop's int16 sums of 4 units
    (32 k) reach their bound, 30,480; the result must still be the exact integer."""
    n, k = 40, 768
    u = torch.full((n, k), 15, dtype=torch.uint8)
    s2 = torch.ones(n, k // group, dtype=torch.uint8) if group else None
    z = torch.zeros((n, k // group) if group else (n,), dtype=torch.uint8)
    mod = PackedW4A8Gemm(qoq_ref.pack_uint4(u), torch.ones(n).half(), s2, z, None, group)
    x = torch.tensor([127.0, -127.0, 127.0]).repeat_interleave(k).view(3, k)
    x[2, ::2] = -127  # mixed signs: sums cancel, still exact
    want = qoq_ref.int8_mm(x.to(torch.int8), u.view(torch.int8))
    assert torch.equal(mod(x), want.float())
    assert want[0, 0] == 15 * 127 * k


@pytest.mark.parametrize("group", [0, 64])
def test_scalar_fallback_is_bit_identical(monkeypatch, group):
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, "scalar")
    assert w4a8_gemm.isa() == "scalar"
    c = _checkpoint(100, 576, group, seed=3)
    mod = _packed(c, group)
    assert not mod.simd
    for m in (1, 7, 33):
        x = _input(m, 576, torch.bfloat16, seed=m)
        assert torch.equal(mod(x), int8_linear(x, c["w8"], c["s1"], c["zref"], c["bias"], cpu_ops=False))


@pytest.mark.parametrize("group", GROUPS)
def test_avx2_path_is_bit_identical(monkeypatch, group):
    """The AVX2 loops (vpmaddubsw on the raw codes) wherever the CPU has AVX2,
    capped there on bigger CPUs: ragged M (decode calls of up to 8 rows walk
    whole tiles in row pairs and a single last row, 9+ rows the four-row
    blocks), ragged N (8-channel halves past N, partial tiles), every input
    dtype."""
    _need("avx2")
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, "avx2")
    assert w4a8_gemm.isa() == "avx2"
    ks = (768,) if group in (128, 256) else (576, 10) if group == 0 else (576,)  # per channel: K ragged to 8
    for (m, n), k in itertools.product(((1, 17), (2, 9), (3, 100), (5, 33), (8, 40), (9, 17), (33, 470)), ks):
        for dtype in (torch.float32, torch.bfloat16):
            c = _checkpoint(n, k, group, seed=m + n + group)
            x = _input(m, k, dtype, seed=m)
            mod = _packed(c, group)
            assert mod.simd == 1
            ref = int8_linear(x, c["w8"], c["s1"], c["zref"], c["bias"], cpu_ops=False)
            assert torch.equal(mod(x), ref), (m, n, group, dtype)


def test_isa_env_var_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="QOQSERVE_CPU_ISA"):
        w4a8_gemm.isa()


def test_leading_dims_are_kept():
    c = _checkpoint(40, 64, 32, seed=5)
    x = torch.randn(2, 3, 64)
    got = _packed(c, 32)(x)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got, int8_linear(x, c["w8"], c["s1"], None, c["bias"], cpu_ops=False))


def test_empty_batch_and_casts():
    c = _checkpoint(20, 64, 32, seed=2)
    mod = _packed(c, 32)
    assert mod(torch.randn(0, 64)).shape == (0, 20)
    with pytest.raises(TypeError, match="fp32"):
        mod.to(torch.bfloat16)  # the epilogue vectors would lose bits


def test_refuses_layouts_it_cannot_run():
    c = _checkpoint(16, 96, 32, seed=1)
    with pytest.raises(ValueError, match="group size 12"):
        PackedW4A8Gemm(c["qweight"], c["s1"], c["s2"], c["zeros"], None, 12)
    with pytest.raises(ValueError, match="group size 64"):  # 96 is no multiple of 64
        PackedW4A8Gemm(c["qweight"], c["s1"], c["s2"], c["zeros"], None, 64)
    s2 = c["s2"].clone()
    s2[0, 0], c["zeros"][0, 0] = 16, 0  # 16 * 15 = 240 leaves INT8
    with pytest.raises(ValueError, match="INT8"):
        PackedW4A8Gemm(c["qweight"], c["s1"], s2, c["zeros"], None, 32)
    s2[0, 0], c["zeros"][0, 0] = 0, 0  # fits INT8 trivially, but s2 - 1 leaves the nibble
    with pytest.raises(ValueError, match="s2 < 1"):
        PackedW4A8Gemm(c["qweight"], c["s1"], s2, c["zeros"], None, 32)


def test_resident_bytes_of_the_embedded_model_stay_under_0_56_per_weight(default_source):
    arch = default_source.arch
    h, d = arch.hidden_size, arch.head_dim
    shapes = [(h, (arch.num_heads + 2 * arch.num_kv_heads) * d), (arch.num_heads * d, h),
              (h, 2 * arch.intermediate_size), (arch.intermediate_size, h)]
    for group in (0, 32, 64):  # every group size the embedded model's K = 576 allows
        for k, n in shapes:
            mod = _packed(_checkpoint(n, k, group, seed=k + n), group, with_bias=False)
            assert mod.resident_bytes <= 0.56 * n * k, (group, k, n, mod.resident_bytes / (n * k))
            assert mod.resident_bytes >= n * k // 2  # it is the whole weight, not a view of part


@pytest.mark.parametrize("isa", ["amx", "avx512-vnni", "avx2", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_fused_into_the_input_is_bit_identical_to_the_op_then_the_gemm(monkeypatch, dtype, isa):
    _need(isa)
    from qoqserve.kernels.cpu import elementwise
    from qoqserve.kernels.cpu.w4a8_gemm import SiluMulInput
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, isa)
    k = 320
    c = _checkpoint(40, k, 64, seed=5)
    mod = _packed(c, 64)
    for m in (1, 2, 7, 33, 48):
        gate_up = _input(m, 2 * k, torch.float32, seed=m) * 2
        gate_up[:, 5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5] * 6)[:m]
        gate_up = gate_up.to(dtype)
        got = mod(SiluMulInput(gate_up))
        assert torch.equal(got, mod(elementwise.silu_mul(gate_up))), (m, dtype, isa)
        assert got.dtype == dtype
    with pytest.raises(ValueError, match="gate | up"):
        mod(SiluMulInput(gate_up[:, :k]))
    with pytest.raises(ValueError, match="group layout"):
        _packed(_checkpoint(40, k, 0, seed=5), 0)(SiluMulInput(gate_up))


def test_the_packed_method_fuses_silu_mul_only_where_it_rounds_alike():
    from qoqserve.kernels.cpu.w4a8_gemm import SiluMulInput
    from qoqserve.layers.quantization.qoq_methods import QoQPackedMethod
    from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
    gate_up = torch.randn(3, 128)
    assert isinstance(QoQPackedMethod(64).input_from_silu_mul(gate_up, CpuTokenOps().silu_mul), SiluMulInput)
    # torch's silu rounds its own way; per channel the epilogue needs the product's torch row sum
    for method, op in ((QoQPackedMethod(64), TorchTokenOps().silu_mul), (QoQPackedMethod(0), CpuTokenOps().silu_mul)):
        assert torch.equal(method.input_from_silu_mul(gate_up, op), op(gate_up))


@pytest.mark.parametrize("isa", ["amx", "avx512-vnni", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_in_the_gate_up_epilogue_is_bit_identical_to_the_gemm_then_the_op(monkeypatch, dtype, isa):
    """silu_pairs: the gate_up GEMM makes silu(gate) * up itself; one or two
    rows (the raw-codes loop), one row tile and
    several (the panel; with AMX, from 12 rows, the tiles: one 16-row tile,
    two, and one past them), a pair left in a 4-block tile (n = 2 x 176), both
    threads' ranges, with and without bias, plain and normalized inputs, and
    gates where the SiLU saturates, underflows or meets a signed zero."""
    _need(isa)
    from qoqserve.kernels.cpu import elementwise
    from qoqserve.kernels.cpu.w4a8_gemm import NormInput
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, isa)
    k = 320
    weight = (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    for n in (352, 1024):
        c = _checkpoint(n, k, 64, seed=n)
        c["s1"][:3] = torch.tensor([60.0, 1e-4, 0.0]).half()  # gates of +-hundreds, tiny ones, zeros
        for with_bias in (False, True):
            plain, pairs = (_packed(c, 64, with_bias, silu_pairs=p) for p in (False, True))
            for m in (1, 2, 6, 7, 12, 13, 16, 33):
                x = _input(m, k, dtype, seed=m + n)
                want = elementwise.silu_mul(plain(x))
                got = pairs.silu_mul(x)
                assert got.shape == (m, n // 2) and got.dtype == dtype
                assert torch.equal(got, want), (n, m, with_bias, dtype, isa)
                assert torch.equal(pairs(x), plain(x))  # forward: gate | up, in the checkpoint's order
                h = x.clone()
                delta = _input(m, k, dtype, seed=100 + m)
                got = pairs.silu_mul(NormInput(h, delta, weight, 1e-5))
                hn = x.clone()
                assert torch.equal(got, elementwise.silu_mul(plain(NormInput(hn, delta, weight, 1e-5))))
                assert torch.equal(h, hn)


def test_a_gate_up_linear_makes_silu_mul_in_its_epilogue_only_where_it_rounds_alike(monkeypatch):
    from qoqserve.layers.linear import Linear
    from qoqserve.layers.quantization.qoq_methods import QoQPackedMethod
    from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
    vnni = best_isa_of_this_cpu() in ("avx512-vnni", "amx")
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, "avx512-vnni" if vnni else "scalar")  # the paths with the epilogue
    c = _checkpoint(2 * 96, 128, 64, seed=3)

    def gate_up(cpu_ops, silu_mul_after=True):
        layer = Linear(128, [96, 96], False, QoQPackedMethod(64, cpu_ops=cpu_ops), torch.float32,
                       silu_mul_after=silu_mul_after)
        for name in ("qweight", "s1", "s2", "zeros"):
            getattr(layer, name).data.copy_(c[name])
        layer.method.process_weights_after_loading(layer)
        return layer

    x = _input(5, 128, torch.float32, seed=4)
    fused, plain = gate_up(True), gate_up(True, silu_mul_after=False)
    assert fused.packed_w4a8.silu_pairs and not plain.packed_w4a8.silu_pairs
    assert torch.equal(fused(x), plain(x))
    cpu_silu, torch_silu = CpuTokenOps().silu_mul, TorchTokenOps().silu_mul
    assert torch.equal(fused.silu_mul_output(x, cpu_silu), cpu_silu(plain(x)))
    # torch's SiLU is not the epilogue's: the model applies it; the torch token ops: no pairs at all
    assert fused.silu_mul_output(x, torch_silu) is None and plain.silu_mul_output(x, cpu_silu) is None
    assert not gate_up(False).packed_w4a8.silu_pairs


def test_silu_pairs_are_refused_where_the_epilogue_cannot_run(monkeypatch):
    c = _checkpoint(64, 128, 64, seed=1)
    for group, n in ((0, 64), (64, 48)):  # per channel; halves of 24 channels
        cc = _checkpoint(n, 128, group, seed=2)
        with pytest.raises(ValueError, match="silu pairs"):
            _packed(cc, group, with_bias=False, silu_pairs=True)
    with pytest.raises(ValueError, match="silu_pairs=True"):
        _packed(c, 64).silu_mul(torch.randn(2, 128))
    if w4a8_gemm.ISAS.index("avx2") <= w4a8_gemm.ISAS.index(best_isa_of_this_cpu()):  # no epilogue there
        monkeypatch.setenv(w4a8_gemm.ISA_ENV, "avx2")
        assert not w4a8_gemm.silu_pairs_supported(64, 64)
        with pytest.raises(ValueError, match="avx2"):
            _packed(c, 64, with_bias=False, silu_pairs=True)


@pytest.mark.parametrize("isa", ["amx", "avx512-vnni", "avx2", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_fused_into_the_input_is_bit_identical_to_the_op_then_the_gemm(monkeypatch, dtype, isa):
    _need(isa)
    from qoqserve.kernels.cpu import elementwise
    from qoqserve.kernels.cpu.w4a8_gemm import NormInput
    monkeypatch.setenv(w4a8_gemm.ISA_ENV, isa)
    k = 320
    weight = (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    # n = 1040: enough work at one or two rows for the kernel to split the
    # blocks between threads (there, each thread makes its own rows and h is
    # written after the threads are done reading it)
    for n, m in ((40, 1), (40, 2), (40, 7), (40, 33), (40, 48), (1040, 1), (1040, 2), (1040, 3)):
        mod = _packed(_checkpoint(n, k, 64, seed=6), 64)
        h = _input(m, k, torch.float32, seed=m).to(dtype)
        delta = _input(m, k, torch.float32, seed=100 + m).to(dtype)
        if m > 2:
            h[2], delta[2] = 0, 0  # an all-zero row: eps alone under the root
        # with the residual add: h is updated in place, as add_rms_norm updates it
        h_op, h_fused = h.clone(), h.clone()
        want = mod(elementwise.add_rms_norm(h_op, delta, weight, 1e-5)[0])
        got = mod(NormInput(h_fused, delta, weight, 1e-5))
        assert torch.equal(got, want), (m, dtype, isa)
        assert torch.equal(h_fused, h_op) and not torch.equal(h_fused, h)
        # without it (the first layer's norm): h is left as it was
        h_alone = h.clone()
        assert torch.equal(mod(NormInput(h_alone, None, weight, 1e-6)), mod(elementwise.rms_norm(h, weight, 1e-6)))
        assert torch.equal(h_alone, h) and got.dtype == dtype
    with pytest.raises(ValueError, match="h's dtype"):
        mod(NormInput(h, delta.float() if dtype == torch.bfloat16 else delta.bfloat16(), weight, 1e-5))
    with pytest.raises(ValueError, match="group layout"):
        _packed(_checkpoint(40, k, 0, seed=5), 0)(NormInput(h, delta, weight, 1e-5))


def test_the_packed_method_fuses_the_norm_only_where_it_rounds_alike():
    from qoqserve.kernels.cpu.w4a8_gemm import NormInput
    from qoqserve.layers.norm import RMSNorm
    from qoqserve.layers.quantization.qoq_methods import QoQPackedMethod
    from qoqserve.layers.token_ops import CpuTokenOps
    h, delta = torch.randn(3, 128), torch.randn(3, 128)
    c_norm, torch_norm = RMSNorm(128, 1e-5, torch.float32, CpuTokenOps()), RMSNorm(128, 1e-5, torch.float32)
    for norm in (c_norm, torch_norm):
        norm.weight.data.uniform_(0.5, 1.5)
    x, h_out = QoQPackedMethod(64).input_from_norm(c_norm, h, delta)
    assert isinstance(x, NormInput) and h_out is h and x.delta is delta  # the add happens in the GEMM
    # torch's norm rounds its own way; per channel the epilogue needs the input's torch row sum;
    # a strided h is not what the kernel reads
    for method, norm, hh, d in ((QoQPackedMethod(64), torch_norm, h, delta), (QoQPackedMethod(0), c_norm, h, delta),
                                (QoQPackedMethod(64), c_norm, torch.randn(3, 256)[:, :128], None)):
        want, h_want = (norm(hh), hh) if d is None else norm(hh.clone(), d)  # the C add is in place
        x, h_out = method.input_from_norm(norm, hh if d is None else hh.clone(), d)
        assert torch.equal(x, want) and torch.equal(h_out, h_want)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("cc")
                    or not cpu_has_avx512(), reason="scripts/gemv_stream.c: an AVX-512 harness built with cc")
def test_the_gemv_stream_harness_builds_and_runs_on_the_kernel_as_it_is(tmp_path):
    """docs/benchmarks.md's batch-1 figures come from scripts/gemv_stream.c, which
    includes the kernel's source: it must keep building (warnings as errors:
    a changed signature is a warning in C) and its GEMV calls must succeed."""
    root = pathlib.Path(__file__).resolve().parent.parent
    exe = tmp_path / "gemv_stream"
    subprocess.run(["cc", "-O1", "-march=x86-64", "-fopenmp", "-ffp-contract=off", "-Wall", "-Werror",
                    f"-I{root / 'qoqserve/kernels/cpu'}", str(root / "scripts/gemv_stream.c"), "-o", str(exe), "-lm"],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe), "2", "1", "1"], check=True, capture_output=True, text=True).stdout
    assert "GEMVs" in out and "ratio" in out
