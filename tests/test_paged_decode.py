"""The C paged decode kernel (both of its paths) against the fp64 torch
reference, over every page format, head_dim, GQA group and block size."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import cpu_has_avx2, cpu_has_avx512, make_pages, page_layout

from qoqserve.kernels.cpu import paged_decode, w4a8_gemm
from qoqserve.layers.attention import AttentionMetadata, PagedAttention
from qoqserve.layers.attention_backends import AttentionBackend, CpuAttention

FORMATS = ["int4", "int8", "bfloat16", "float16", "float32"]
# (query heads, KV heads, head_dim): groups 3/4/8/1/2; 64 and 128 are the unrolled
# rows, 80, 96 and 40 the generic path (not a multiple of 32: masked tails). KV4
# V rows take all heads of a group at once up to 4 heads (80: more, the other loop).
# 176: more than one register block of V sums and a last partial one
SHAPES = [(9, 3, 64), (8, 2, 128), (8, 1, 80), (4, 4, 96), (4, 2, 40), (4, 1, 176)]
# 1 token, page-size multiples and not, and one longer than a chunk (256
# tokens) so that chunk partials are merged
LENS = [1, 16, 50, 100, 301]


def _layouts(fmt, hkv, d, bs):
    """(the page layout, the C kernels over it)"""
    layout = page_layout(fmt, hkv, d, bs)
    return layout, CpuAttention(layout)


def _case(fmt, heads, hkv, d, bs, lens=LENS, seed=0):
    layout, c_layout = _layouts(fmt, hkv, d, bs)
    blocks = sum(-(-n // bs) for n in lens) + 3
    _, cache, tables, ctx = make_pages(heads, hkv, d, lens, bs=bs, num_blocks=blocks, seed=seed, layout=layout)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(seed + 1))
    return layout, c_layout, cache, tables, ctx, q


def _reference(layout, heads, hkv, d, q, cache, tables, ctx):
    attn = PagedAttention(heads, hkv, d, AttentionBackend(layout))  # gather, dequantize, fp64 SDPA
    return attn(q, None, None, AttentionMetadata(False, None, tables, ctx), cache).view(q.shape)


def _best_path() -> str:
    return "avx512" if cpu_has_avx512() else "avx2" if cpu_has_avx2() else "scalar"


def test_the_vector_path_is_taken_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
    assert paged_decode.isa() == _best_path()
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx2")
    assert paged_decode.isa() == ("avx2" if cpu_has_avx2() else "scalar")
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "scalar")
    assert paged_decode.isa() == "scalar"


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86 disassembly with objdump")
def test_each_task_prefetches_its_first_pages():
    # GCC drops calls to a function made only of prefetches (it finds no side
    # effect), so nothing but the built code shows the prefetch is there
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", paged_decode.load()._name],
                         capture_output=True, text=True, check=True).stdout
    region = "<paged_decode_attention._omp_fn.0>:"  # GCC's name for the kernel's parallel region
    if region not in out:
        pytest.skip("not built by GCC (the trap checked here is GCC's)")
    # the task loop: decode_part, called from that region and from a running team (or inlined there)
    bodies = [out.split(name, 1)[1].split("\n\n", 1)[0] for name in (region, "<decode_part>:") if name in out]
    assert any("prefetcht1" in body for body in bodies)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("heads,hkv,d", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_attention_matches_the_fp64_reference(fmt, heads, hkv, d, bs, isa):
    layout, c_layout, cache, tables, ctx, q = _case(fmt, heads, hkv, d, bs)
    got = c_layout.decode(q, cache, tables, ctx, d ** -0.5)
    ref = _reference(layout, heads, hkv, d, q, cache, tables, ctx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _cpu_has_vnni() -> bool:
    return cpu_has_avx512() and "avx512_vnni" in open("/proc/cpuinfo").read()


def test_kv4_scores_take_vnni_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
    vector = cpu_has_avx512() or cpu_has_avx2()
    assert paged_decode.kv4_scores() == ("vnni" if _cpu_has_vnni() else "fp32" if vector else "scalar")
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512")  # AVX-512 without VNNI, for every CPU kernel
    assert paged_decode.kv4_scores() == ("fp32" if vector else "scalar")
    assert paged_decode.isa() == _best_path()
    # the packed GEMM has no AVX-512 path without VNNI: the AVX2 one
    assert w4a8_gemm.isa() == ("avx2" if "avx2" in open("/proc/cpuinfo").read().split() else "scalar")


@pytest.fixture(params=["vnni", "fp32", "avx2"])
def kv4_scores(request, monkeypatch):
    """Every vector path of the KV4 scores, each checked to be the one taken
    (avx2: fp32 scores at 8 lanes)."""
    have = {"vnni": _cpu_has_vnni(), "fp32": cpu_has_avx512(), "avx2": cpu_has_avx2()}[request.param]
    if not have:
        pytest.skip(f"no {request.param} KV4 scores on this CPU")
    if request.param == "vnni":
        monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512" if request.param == "fp32" else "avx2")
    assert paged_decode.kv4_scores() == ("vnni" if request.param == "vnni" else "fp32")
    assert paged_decode.isa() == ("avx2" if request.param == "avx2" else "avx512")
    return request.param


@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("heads,hkv,d", SHAPES + [(6, 2, 24), (16, 1, 256)])
def test_kv4_scores_of_either_vector_path_match_the_fp64_reference(heads, hkv, d, bs, kv4_scores):
    # 24: one partial 8-dword segment; 80/96/256: several segments; page size 8: blocks shorter than 16 rows
    layout, c_layout, cache, tables, ctx, q = _case("int4", heads, hkv, d, bs, seed=5)
    q = q * 4  # scores of several units: the query's integer digits must keep them to fp32 precision
    got = c_layout.decode(q, cache, tables, ctx, d ** -0.5)
    ref = _reference(layout, heads, hkv, d, q, cache, tables, ctx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_kv4_score_paths_are_two_and_agree(monkeypatch):
    if not _cpu_has_vnni():
        pytest.skip("one KV4 score path only on this CPU")
    _, c_layout, cache, tables, ctx, q = _case("int4", 12, 3, 64, 16, seed=3)
    monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
    vnni = c_layout.decode(q, cache, tables, ctx, 0.125)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512")
    fp32 = c_layout.decode(q, cache, tables, ctx, 0.125)
    torch.testing.assert_close(vnni, fp32, rtol=1e-5, atol=1e-5)
    assert not torch.equal(vnni, fp32)


@pytest.mark.parametrize("path", ["avx512", "avx2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_vector_path_agrees_with_the_portable_one(fmt, path, monkeypatch):
    if not (cpu_has_avx512() if path == "avx512" else cpu_has_avx2()):
        pytest.skip(f"no {path} path on this CPU")
    _, c_layout, cache, tables, ctx, q = _case(fmt, 12, 3, 64, 16, seed=3)
    if path == "avx2":
        monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx2")
    assert paged_decode.isa() == path
    vec = c_layout.decode(q, cache, tables, ctx, 0.125)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "scalar")
    scalar = c_layout.decode(q, cache, tables, ctx, 0.125)
    torch.testing.assert_close(vec, scalar, rtol=1e-5, atol=1e-5)
    assert not torch.equal(vec, scalar) or fmt == "float32"  # two real paths, not one twice


@pytest.mark.parametrize("fmt", ["int4", "bfloat16", "int8"])
def test_a_sequence_does_not_depend_on_its_batch_nor_the_thread_count(fmt, isa):
    lens = [33, 7, 600, 64, 5, 290]
    layout, c_layout, cache, tables, ctx, q = _case(fmt, 9, 3, 64, 16, lens=lens, seed=1)
    batched = c_layout.decode(q, cache, tables, ctx, 0.125)
    for i, n in enumerate(lens):
        width = -(-n // 16)
        alone = c_layout.decode(q[i:i + 1], cache, tables[i:i + 1, :width], ctx[i:i + 1], 0.125)
        assert torch.equal(alone[0], batched[i]), i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = c_layout.decode(q, cache, tables, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batched)


def test_an_empty_context_gives_zeros_not_nan(isa):
    _, c_layout, cache, tables, ctx, q = _case("int4", 4, 2, 64, 16, lens=[5, 9])
    out = c_layout.decode(q, cache, tables, torch.tensor([0, 9]), 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()


@pytest.mark.parametrize("bs", [8, 24])
@pytest.mark.parametrize("fmt", ["int4", "int8", "bfloat16"])
def test_block_sizes_that_are_not_multiples_of_16(fmt, bs, isa):
    heads, hkv, d = 6, 2, 64
    layout, c_layout, cache, tables, ctx, q = _case(fmt, heads, hkv, d, bs, lens=[1, 23, 70, 300])
    got = c_layout.decode(q, cache, tables, ctx, d ** -0.5)
    ref = _reference(layout, heads, hkv, d, q, cache, tables, ctx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


_GUARDED = r"""
import ctypes, mmap, sys, torch
from qoqserve.layers import kv_cache as kc
from qoqserve.layers.attention_backends import CpuAttention
fmt, hkv, d, blocks = sys.argv[1], 3, 64, 4
for bs in (16, 7):
    layout = (kc.Int4KVCacheLayout if fmt == "int4" else kc.Int8KVCacheLayout)(hkv, d, bs)
    shape = layout.allocate(blocks, "cpu").shape
    nbytes, page = shape.numel(), mmap.PAGESIZE
    span = (nbytes + page - 1) // page * page + page
    buf = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + span - page), page, 0) == 0  # no access
    cache = torch.frombuffer(buf, dtype=torch.uint8)[span - page - nbytes:span - page].view(shape)
    cache.zero_()
    torch.manual_seed(0)
    tables = torch.tensor([[blocks - 1, 0, 0, 0], [3, 2, 1, 0]])  # the pool's last page, then every page
    lens = torch.tensor([bs, 4 * bs])
    for i in range(2):
        pos = torch.arange(int(lens[i]))
        slots = tables[i, pos // bs] * bs + pos % bs
        layout.write(cache, torch.randn(len(pos), hkv, d), torch.randn(len(pos), hkv, d), slots)
    out = CpuAttention(layout).decode(torch.randn(2, 9, d), cache, tables, lens, d ** -0.5)
    print(bs, "ok" if torch.isfinite(out).all() else "not finite")
"""


@pytest.mark.parametrize("path", ["best", "avx512", "avx2", "scalar"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_no_read_passes_the_end_of_the_pool(fmt, path, tmp_path):
    """The pool's last bytes are a quantized row's scale (and zero): the
    kernel reads them with a gather, which must stay inside the row. The
    pool here ends where an inaccessible page begins, so a read past its end
    kills the process (in a child, so that it fails this test alone)."""
    have = {"best": True, "avx512": cpu_has_avx512(), "avx2": cpu_has_avx2(), "scalar": True}[path]
    if not have:
        pytest.skip(f"no {path} path on this CPU")
    env = {k: v for k, v in os.environ.items() if k != "QOQSERVE_CPU_ISA"}
    if path != "best":
        env["QOQSERVE_CPU_ISA"] = path
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    run = subprocess.run([sys.executable, str(script), fmt], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split() == ["16", "ok", "7", "ok"], (run.returncode, run.stdout,
                                                                                 run.stderr[-2000:])
