"""The C kernels of the CPU path against their torch references."""
from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch
from conftest import cpu_has_avx2, make_pages, page_layout

from qoqserve.kernels.cpu import paged_decode
from qoqserve.layers.attention import AttentionMetadata, PagedAttention
from qoqserve.layers.attention_backends import AttentionBackend, CpuAttention


def test_the_kernel_builds_here():
    assert paged_decode.available()  # a compiler is part of the set-up; no silent fallback in CI


def _pages(fmt, hkv, d, bs=16):
    """(the page layout, the C kernels over it) for a page format"""
    layout = page_layout(fmt, hkv, d, bs)
    return layout, CpuAttention(layout)


FORMATS = ["int4", "int8", "bfloat16", "float16", "float32"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 2, 80)])
def test_c_decode_attention_matches_the_torch_path(fmt, heads, hkv, d):
    lens = [1, 17, 50, 100]
    layout, c_layout = _pages(fmt, hkv, d)
    _, cache, tables, ctx = make_pages(heads, hkv, d, lens, layout=layout)
    q = torch.randn(len(lens), heads, d)
    got = c_layout.decode(q, cache, tables, ctx, d ** -0.5)
    attn = PagedAttention(heads, hkv, d, AttentionBackend(layout))  # gather, dequantize, fp64 SDPA
    ref = attn(q, None, None, AttentionMetadata(False, None, tables, ctx), cache).view(len(lens), heads, d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_c_decode_attention_of_a_sequence_does_not_depend_on_its_batch(fmt):
    lens = [33, 7, 120, 64, 5]
    layout, c_layout = _pages(fmt, 3, 64)
    _, cache, tables, ctx = make_pages(9, 3, 64, lens, seed=1, layout=layout)
    q = torch.randn(len(lens), 9, 64)
    batched = c_layout.decode(q, cache, tables, ctx, 0.125)
    for i, n in enumerate(lens):
        width = -(-n // 16)
        alone = c_layout.decode(q[i:i + 1], cache, tables[i:i + 1, :width], ctx[i:i + 1], 0.125)
        assert torch.equal(alone[0], batched[i])


@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
@pytest.mark.parametrize("lens", [[300], [10, 20, 280]])
def test_bf16_queries_are_their_fp32_values_and_come_back_rounded(fmt, lens):
    # widened and rounded inside the kernel call (a captured bf16 step replays
    # it), with one sequence split over the threads and with several
    layout, c_layout = _pages(fmt, 2, 64)
    _, cache, tables, ctx = make_pages(4, 2, 64, lens, layout=layout)
    q = torch.randn(len(lens), 4, 64).bfloat16()
    out = c_layout.decode(q, cache, tables, ctx, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.equal(out, c_layout.decode(q.float(), cache, tables, ctx, 0.125).bfloat16())


def test_c_decode_attention_refuses_rows_of_another_format():
    from qoqserve.kernels.cpu.paged_decode import paged_decode_attention

    layout, _ = _pages("bfloat16", 2, 64)
    _, cache, tables, ctx = make_pages(4, 2, 64, [10], layout=layout)
    k, v = layout.page_rows(cache)
    with pytest.raises(ValueError, match="unsupported shapes"):
        paged_decode_attention(torch.randn(1, 4, 64), k, v, "float32", 16, tables, ctx, 0.125)


# ---- per-token INT8 quantization and the W4A8 epilogue in C ------------------

from qoqserve.kernels import qoq_ref  # noqa: E402
from qoqserve.kernels.cpu import w4a8_ops  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_activation_quant_is_bit_identical_to_the_reference(dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).to(dtype)
    x[5] = 0                                    # an all-zero row: scale 1
    x[7, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5]).to(dtype)  # exact ties round to even
    q, s = w4a8_ops.quantize_act_int8(x)
    ref_q, ref_s = qoq_ref.quantize_act_int8(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channel", [False, True])
def test_c_epilogue_is_bit_identical_to_the_torch_epilogue(out_dtype, channel):
    torch.manual_seed(1)
    acc = torch.randint(-2**20, 2**20, (9, 70), dtype=torch.int32)
    s_a, s1 = torch.rand(9), (torch.rand(70) * 1e-2).half()
    rowsum = torch.randn(9) * 30 if channel else None
    zs1 = torch.randint(0, 16, (70,)).float() * s1.float() if channel else None
    bias = torch.randn(70).half()
    got = w4a8_ops.epilogue(acc, s_a, s1, out_dtype, rowsum, zs1, bias)
    ref = acc.float() * s_a[:, None] * s1.float()
    if channel:
        ref = ref - rowsum[:, None] * zs1
    ref = (ref + bias.float()).to(out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, ref)


def test_quantized_linears_give_the_same_output_with_and_without_c_ops():
    from qoqserve.layers.quantization.int8_gemm import int8_linear

    torch.manual_seed(2)
    for zeros in (None, torch.randint(0, 16, (48,), dtype=torch.uint8)):
        w = torch.randint(0, 16, (48, 64), dtype=torch.uint8) if zeros is not None else \
            torch.randint(-128, 128, (48, 64), dtype=torch.int8)
        s1 = (torch.rand(48) * 1e-2).half()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, 64).to(dtype)
            assert torch.equal(int8_linear(x, w, s1, zeros, None, True), int8_linear(x, w, s1, zeros, None, False))


# ---- the fused INT8 linear (quantize + VNNI GEMM + epilogue in one call) -----

from qoqserve.kernels.cpu import int8_linear as fused  # noqa: E402
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, int8_linear  # noqa: E402


def test_the_fused_kernel_builds_here():
    # every x86-64 CPU CI runs on has AVX2 or AVX-512 VNNI: no silent fallback
    assert fused.available()
    flags = set(open("/proc/cpuinfo").read().split())
    assert fused.isa() == ("avx512-vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else "avx2")


def test_the_avx2_build_is_bit_identical_to_the_reference(monkeypatch):
    """The AVX2 loops, built as for a CPU without AVX-512 (-march=x86-64-v3
    after -march=native), on CPUs with AVX-512 too."""
    import ctypes

    from qoqserve.kernels.cpu import build
    if "avx2" not in open("/proc/cpuinfo").read().split():
        pytest.skip("this CPU lacks AVX2")
    lib = ctypes.CDLL(build._build(fused.__file__.replace(".py", ".c"), ["-ffp-contract=off", "-march=x86-64-v3"]))
    for fn_name, (restype, argtypes) in fused._SIGNATURES.items():
        getattr(lib, fn_name).restype, getattr(lib, fn_name).argtypes = restype, argtypes
    assert lib.int8_linear_available() == 1
    monkeypatch.setattr(fused, "load", lambda: lib)
    assert fused.isa() == "avx2"
    for (m, n, k), channel, dtype in itertools.product(((1, 576, 576), (2, 40, 64), (3, 9, 20), (5, 17, 13),
                                                        (7, 100, 60), (33, 200, 1536)),
                                                       (False, True), (torch.float32, torch.bfloat16)):
        w, s1, zeros, bias = _int8_case(n, k, channel, seed=m * 1000 + n)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
        x[0, : min(k, 4)] = torch.tensor([127.0, 0.5, -0.5, 1.5])[: min(k, 4)].to(dtype)
        if m > 2:
            x[2] = 0
        got = PackedInt8Gemm(w, s1, zeros, bias)(x)
        assert torch.equal(got, int8_linear(x, w, s1, zeros, bias, cpu_ops=False)), (m, n, k, channel, dtype)


def test_the_other_vendors_prefetch_build_is_bit_identical(monkeypatch):
    """int8_linear.c streams its weights with another prefetch hint on AMD
    (-DQOQ_CPU_AMD) than elsewhere: whichever this CPU did not get, built
    here, gives the reference's bits too (a hint must change no result)."""
    import ctypes

    from qoqserve.kernels.cpu import build
    other = [] if build.cpu_vendor_flags() else ["-DQOQ_CPU_AMD"]
    lib = ctypes.CDLL(build._build(fused.__file__.replace(".py", ".c"), ["-ffp-contract=off", *other]))
    for fn_name, (restype, argtypes) in fused._SIGNATURES.items():
        getattr(lib, fn_name).restype, getattr(lib, fn_name).argtypes = restype, argtypes
    monkeypatch.setattr(fused, "load", lambda: lib)
    for (m, n, k), channel in itertools.product(((1, 576, 576), (3, 9, 20), (1, 4000, 576)), (False, True)):
        w, s1, zeros, bias = _int8_case(n, k, channel, seed=m * 1000 + n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
        got = PackedInt8Gemm(w, s1, zeros, bias)(x)
        assert torch.equal(got, int8_linear(x, w, s1, zeros, bias, cpu_ops=False)), (m, n, k, channel)


def test_cpu_vendor_flags_name_amd_cpus_only(tmp_path):
    from qoqserve.kernels.cpu.build import cpu_vendor_flags
    for vendor, want in (("AuthenticAMD", ["-DQOQ_CPU_AMD"]), ("GenuineIntel", [])):
        f = tmp_path / vendor
        f.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 26\n")
        assert cpu_vendor_flags(str(f)) == want
    assert cpu_vendor_flags(str(tmp_path / "missing")) == []


def test_absent_isa_flags_leave_out_avx512_only_where_the_cpu_lacks_it():
    import platform

    from qoqserve.kernels.cpu.build import absent_isa_flags
    full = b"flags\t: fpu sse2 avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni\n"
    without = b"flags\t: fpu sse2 avx2 fma f16c avx512f\n"  # AVX-512 F alone is not enough
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert absent_isa_flags(without) == []  # nothing to leave out off x86
        return
    assert absent_isa_flags(full) == []
    assert absent_isa_flags(without) == ["-DQOQ_NO_AVX512"]


@pytest.mark.skipif(not cpu_has_avx2(), reason="the build without AVX-512 runs the AVX2 path")
def test_a_build_without_avx512_runs_the_avx2_attention(monkeypatch):
    """What an AVX2-only CPU builds, built and asked here on any x86 CPU: it
    compiles, and its attention takes the AVX2 path (on an AVX2-only CPU this
    is the cached build the suite uses)."""
    import ctypes

    from qoqserve.kernels.cpu import build, paged_decode
    monkeypatch.setattr(build, "absent_isa_flags", lambda: ["-DQOQ_NO_AVX512"])
    lib = ctypes.CDLL(build._build(paged_decode.__file__.replace(".py", ".c"), paged_decode._FLAGS))
    assert lib.paged_decode_isa() == 256


def test_two_processes_build_a_library_once(tmp_path):
    """A second process that wants a library another is building waits for it
    and loads its file (parallel test workers, a server and a quantizer started
    together), instead of compiling it again."""
    import subprocess
    import sys
    import textwrap

    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    real = shutil.which("cc") or shutil.which("gcc")
    cc.write_text(f"#!/bin/sh\necho $$ >> {log}\nsleep 1\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    code = textwrap.dedent("""
        from qoqserve.kernels.cpu import build, token_mask
        print(build._build(token_mask.__file__.replace(".py", ".c"), []))
    """)
    env = {**os.environ, "CC": str(cc), "QOQSERVE_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    paths = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert paths[0] == paths[1] and os.path.isfile(paths[0])
    assert len(log.read_text().split()) == 1  # one compiler ran


def _int8_case(n, k, channel, seed):
    g = torch.Generator().manual_seed(seed)
    if channel:
        w = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        zeros = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=g)
    else:  # the full signed range, -128 included (s2*(u - z) reaches it)
        w, zeros = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), None
    s1 = (torch.rand(n, generator=g) * 1e-2).half()
    bias = torch.randn(n, generator=g).half()
    return w, s1, zeros, bias


# M across the 6-row tile (1, 5, 6, 7, 32, 67), N across the 16/64-column blocks,
# K not a multiple of 4 or 16 (padded with zero codes)
@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (5, 17, 13), (7, 100, 60), (32, 960, 576),
                                   (67, 64, 1536), (6, 1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channel", [False, True])
def test_fused_int8_linear_is_bit_identical_to_the_three_pass_path(m, n, k, dtype, channel):
    w, s1, zeros, bias = _int8_case(n, k, channel, seed=m * 1000 + n)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    x[0, : min(k, 4)] = torch.tensor([127.0, 0.5, -0.5, 1.5])[: min(k, 4)].to(dtype)  # ties
    if m > 2:
        x[2] = 0  # an all-zero row: scale 1, codes 0
    for b in (None, bias):
        got = PackedInt8Gemm(w, s1, zeros, b)(x)
        ref = int8_linear(x, w, s1, zeros, b, cpu_ops=False)  # the torch reference
        assert got.dtype == dtype and torch.equal(got, ref)


@pytest.mark.parametrize("channel", [False, True])
def test_fused_int8_linear_on_amx_tiles_is_bit_identical(monkeypatch, channel):
    """Rows from the fewest the tiles take (12, padded to 16) up and past one
    32-row pass, N ending in one or two blocks of a 4-block tile, K of whole
    64-byte tile rows (576, 1536: the tiles) and not (100: the VNNI loops);
    against the VNNI loops and torch."""
    monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
    flags = open("/proc/cpuinfo").read().split()
    assert fused.uses_amx() == ("amx_tile" in flags and "amx_int8" in flags)
    if not fused.uses_amx():
        pytest.skip("no AMX-INT8 on this CPU")
    for m, n, k in ((12, 40, 576), (16, 17, 576), (17, 100, 1536), (33, 48, 576), (130, 200, 576),
                    (64, 96, 100), (16, 576, 576)):
        w, s1, zeros, bias = _int8_case(n, k, channel, seed=m + n + k)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).bfloat16()
        x[2] = 0
        gemm = PackedInt8Gemm(w, s1, zeros, bias)
        got = gemm(x)
        monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512-vnni")
        assert not fused.uses_amx()
        assert torch.equal(got, gemm(x)), (m, n, k)
        monkeypatch.delenv("QOQSERVE_CPU_ISA")
        assert torch.equal(got, int8_linear(x, w, s1, zeros, bias, cpu_ops=False)), (m, n, k)


def test_fused_int8_linear_keeps_fp16_and_leading_dims():
    w, s1, zeros, bias = _int8_case(40, 64, False, seed=3)
    x = torch.randn(2, 3, 64).half()
    got = PackedInt8Gemm(w, s1, zeros, bias)(x)
    assert got.shape == (2, 3, 40) and got.dtype == torch.float16
    assert torch.equal(got, int8_linear(x, w, s1, zeros, bias, cpu_ops=False))


def test_pack_weight_refuses_codes_that_leave_the_byte_range():
    with pytest.raises(ValueError, match="0..255"):
        fused.pack_weight(torch.full((16, 8), 200, dtype=torch.uint8), 128)


# ---- KV4 page write in C -------------------------------------------------------

@pytest.mark.parametrize("hkv,d", [(3, 64), (2, 600)])  # 600: rows longer than the kernel's chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_c_kv4_write_is_byte_identical_to_the_torch_layout(dtype, hkv, d):
    from qoqserve.kernels.cpu import kv4_write
    from qoqserve.layers.kv_cache import Int4KVCacheLayout

    assert kv4_write.available()
    layout = Int4KVCacheLayout(hkv, d, 16)
    torch.manual_seed(4)
    k, v = (torch.randn(37, hkv, d) * 4).to(dtype), torch.randn(37, hkv, d).to(dtype)
    k[3, 1] = 0.25                # a constant head: range 0, the amax floor decides
    k[4, 1] = 0                   # all zero: the smallest fp16 scale
    v[5, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, 7.5, -7.5, 3.0, -3.0]).to(dtype)  # ties
    slots = torch.randperm(64 * 16)[:37]
    ref, got = layout.allocate(64, "cpu"), layout.allocate(64, "cpu")
    layout.write(ref, k, v, slots)
    kv4_write.kv4_write(got, k, v, slots)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kv4_write_takes_the_sign_of_a_zero_minimum_from_the_first_zero(dtype):
    """Where the minimum is a zero, the in-order min keeps the first zero it
    meets, and its sign reaches the stored zero point (-lo / scale): the
    vector min/max must pick the same one."""
    from qoqserve.kernels.cpu import kv4_write
    from qoqserve.layers.kv_cache import Int4KVCacheLayout

    d = 64
    layout = Int4KVCacheLayout(1, d, 16)
    for first, later, at in ((-0.0, 0.0, 3), (0.0, -0.0, 3), (-0.0, 0.0, 40), (0.0, -0.0, 17)):
        k = torch.linspace(0.5, 3.0, d)
        k[at], k[at + 5], k[at + 20] = first, later, later  # positions in different vector lanes
        k = k.view(1, 1, d).to(dtype)
        cache = layout.allocate(1, "cpu")
        kv4_write.kv4_write(cache, k, k, torch.tensor([0]))
        zero = cache[0, 0, 0, 0, d // 2 + 2:d // 2 + 4].view(torch.float16)  # slot 0, K, head 0
        first_is_negative = str(first) == "-0.0"
        assert zero.item() == 0 and torch.signbit(zero).item() == (not first_is_negative), (first, at)


def test_w8a8_linear_runs_on_the_fused_kernel_and_matches_its_references():
    import torch.nn.functional as F

    from qoqserve.kernels.cpu import int8_linear as fused_kernel
    from qoqserve.layers.linear import Linear
    from qoqserve.layers.quantization.w8a8 import W8A8LinearMethod

    torch.manual_seed(5)
    w, b = torch.randn(96, 80) * 0.1, torch.randn(96)
    fused, plain = (Linear(80, 96, True, W8A8LinearMethod(cpu_ops=n, fused=n), torch.float32)
                    for n in (True, False))
    for lin in (fused, plain):
        lin.weight.copy_(w)
        lin.bias.copy_(b)
        lin.method.process_weights_after_loading(lin)
    assert fused.method.describe(fused) == "w8a8/torch-int8" + fused_kernel.suffix()
    assert plain.method.describe(plain) == "w8a8/torch-int8"
    x = torch.randn(7, 80)
    got = fused(x)
    assert torch.equal(got, plain(x))  # the torch _int_mm path on the same INT8 weights
    ref = F.linear(x, w, b)            # W8A8 vs full precision: per-token/per-channel INT8 error
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_the_package_ships_every_c_kernel_source():
    """They are compiled on first use (with the headers they include), so a wheel
    without them has no C path."""
    import fnmatch
    import pathlib

    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["qoqserve"]
    sources = [p.relative_to(root / "qoqserve").as_posix() for ext in ("*.c", "*.h")
               for p in (root / "qoqserve").rglob(ext)]
    assert sources
    for src in sources:
        assert any(fnmatch.fnmatch(src, pat) for pat in patterns), src


def test_prebuild_builds_every_c_kernel_of_the_package():
    import pathlib

    from qoqserve.kernels.cpu import prebuild

    sources = {p.stem for p in pathlib.Path(prebuild.__file__).parent.glob("*.c")}
    built = prebuild.build_all()
    assert set(built) == sources  # each .c has its loader module, and each is built
    assert all(built.values()), built  # a compiler is part of the set-up: none falls back


def test_two_kernels_build_at_the_same_time(monkeypatch, tmp_path):
    """One lock per library, not one for all: two first builds overlap (a shared
    lock would leave the second waiting and the barrier would time out)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from qoqserve.kernels.cpu import build

    barrier = threading.Barrier(2, timeout=20)
    real_build = build._build

    def build_meeting_the_other(source, flags):
        barrier.wait()
        return real_build(source, flags)

    monkeypatch.setattr(build, "_build", build_meeting_the_other)
    for name in ("token_mask", "kv4_write"):
        monkeypatch.delitem(build._libs, name, raising=False)
    sigs = {"token_mask": {}, "kv4_write": {}}
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda n: build.load_library(n, [], sigs[n]), sigs))
    assert all(lib is not None for lib in libs)
