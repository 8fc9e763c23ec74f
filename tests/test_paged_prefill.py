"""The C paged prefill kernel (each of its paths, the AMX tiles for KV4 pages
included) against an fp64 reference over every page format, head_dim, GQA
group and block size, and its invariance: a query's result must not depend
on how its prompt was chunked, what shares the call, or the thread count."""
from __future__ import annotations

import pytest
import torch
from conftest import cpu_has_avx2, cpu_has_avx512, make_pages, page_layout

from qoqserve.kernels.cpu import paged_prefill
from qoqserve.layers.attention_backends import CpuAttention

FORMATS = ["int4", "int8", "bfloat16", "float16", "float32"]
SHAPES = [(9, 3, 64), (8, 2, 128), (8, 1, 80), (4, 4, 96), (4, 1, 176)]  # 176: blocks of V sums and a last part


def _case(fmt, heads, hkv, d, bs, lens, seed=0):
    layout = page_layout(fmt, hkv, d, bs)
    blocks = sum(-(-n // bs) for n in lens) + 3
    _, cache, tables, _ = make_pages(heads, hkv, d, lens, bs=bs, num_blocks=blocks, seed=seed, layout=layout)
    return layout, CpuAttention(layout, quantized_prefill=True), cache, tables  # attend to the pages as stored


def _reference(layout, q, cache, tables, starts, firsts, scale):
    """Each chunk's queries over positions 0..own, from the pages read in fp64."""
    heads, outs = q.shape[1], []
    for i in range(len(firsts)):
        qi = q[starts[i]:starts[i + 1]].double()
        n = qi.shape[0]
        k, v = (x[0, :firsts[i] + n] for x in layout.read(cache, tables[i:i + 1], torch.float64))
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)   # [L, H, D]
        scores = torch.einsum("thd,lhd->htl", qi, k) * scale
        pos = firsts[i] + torch.arange(n)
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", torch.softmax(scores, -1), v))
    return torch.cat(outs).float()


def _queries(t, heads, d, seed):
    return torch.randn(t, heads, d, generator=torch.Generator().manual_seed(seed)) * 2


def _against_the_reference(fmt, heads, hkv, d, bs, lens, chunks, seed):
    """The last `chunks[i]` queries of sequences of `lens[i]` tokens (the rest a
    cached prefix), all in one call, held to the fp64 reference at 1e-5."""
    layout, attn, cache, tables = _case(fmt, heads, hkv, d, bs, lens, seed=seed)
    firsts = [n - c for n, c in zip(lens, chunks)]
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c)
    q = _queries(starts[-1], heads, d, seed=seed + 1)
    got = attn.prefill(q, cache, tables, starts, firsts, d ** -0.5)
    ref = _reference(layout, q, cache, tables, starts, firsts, d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    return attn, cache, tables, q, starts, firsts, got


@pytest.mark.parametrize("bs", [16, 24])
@pytest.mark.parametrize("heads,hkv,d", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_attention_matches_the_fp64_reference(fmt, heads, hkv, d, bs, isa):
    # whole prompts (first position 0) and chunks after a cached prefix, of
    # lengths around the 16- and 48-key tiles and the 16- to 64-query tasks
    _against_the_reference(fmt, heads, hkv, d, bs, [1, 40, 77, 130], [1, 40, 9, 70], seed=0)


def _invariant(attn, cache, tables, q, other, sizes, single=()):
    """Sequence 0's queries q (all of its prompt) give the same bits whole, cut
    into chunks of each size (in one call, and the first three one call each,
    as are the `single` (start, end) ones), behind sequence 1's `other` in one
    batch, and on 1 or 8 threads (8: tasks of 16 queries instead of 64)."""
    n, m = q.shape[0], other.shape[0]
    whole = attn.prefill(q, cache, tables[:1], [0, n], [0], 0.125)
    for size in sizes:
        cuts = list(range(0, n, size)) + [n]
        rows = tables[:1].expand(len(cuts) - 1, -1)
        assert torch.equal(attn.prefill(q, cache, rows, cuts, cuts[:-1], 0.125), whole), size
        single = [*single, *zip(cuts[:3], cuts[1:4])]
    for a, b in single:
        assert torch.equal(attn.prefill(q[a:b], cache, tables[:1], [0, b - a], [a], 0.125), whole[a:b]), (a, b)
    mixed = attn.prefill(torch.cat([other, q]), cache, tables[[1, 0]], [0, m, m + n], [0, 0], 0.125)
    assert torch.equal(mixed[m:], whole)
    threads = torch.get_num_threads()
    for t in (1, 8):
        try:
            torch.set_num_threads(t)
            alone = attn.prefill(q, cache, tables[:1], [0, n], [0], 0.125)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, whole), t


@pytest.mark.parametrize("fmt", ["int4", "bfloat16", "float32"])
def test_a_query_does_not_depend_on_chunking_batch_or_threads(fmt, isa):
    heads, hkv, d, n = 9, 3, 64, 150
    _, attn, cache, tables = _case(fmt, heads, hkv, d, 16, [n, 60])
    _invariant(attn, cache, tables, _queries(n, heads, d, seed=2), _queries(60, heads, d, seed=3), (1, 7, 64))


def _amx_from(d):
    """The first position whose queries take the AMX tiles (KV4 pages), or a skip."""
    pos = paged_prefill.amx_from("int4", d)
    if pos is None:
        pytest.skip("no AMX-INT8 path for KV4 prefill on this CPU")
    return pos


def _positions(starts, firsts):
    return torch.cat([f + torch.arange(b - a) for a, b, f in zip(starts, starts[1:], firsts)])


@pytest.mark.parametrize("bs", [16, 24])
@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_amx_prefill_matches_the_fp64_reference_and_the_fp32_path(heads, hkv, d, bs, monkeypatch):
    # queries on both sides of the first AMX position, whole prompts and chunks
    # after a cached prefix, around the 64-key tiles and 16-row blocks
    start = _amx_from(d)
    lens, chunks = [start + 1, start + 130, start + 333, 70], [start + 1, 70, 9, 70]
    attn, cache, tables, q, starts, firsts, got = _against_the_reference("int4", heads, hkv, d, bs, lens, chunks,
                                                                         seed=5)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512-vnni")  # the AVX-512 fp32 path for every query
    assert paged_prefill.amx_from("int4", d) is None
    fp32 = attn.prefill(q, cache, tables, starts, firsts, d ** -0.5)
    early = _positions(starts, firsts) < start
    assert torch.equal(got[early], fp32[early])          # before `start`: the fp32 path itself
    assert not torch.equal(got[~early], fp32[~early])    # from it: the tiles, their own rounding
    torch.testing.assert_close(got, fp32, rtol=1e-5, atol=2e-5)


def test_amx_prefill_does_not_depend_on_chunking_batch_or_threads():
    heads, hkv, d = 9, 3, 64
    n = _amx_from(d) + 200
    _, attn, cache, tables = _case("int4", heads, hkv, d, 16, [n, 300], seed=7)
    _invariant(attn, cache, tables, _queries(n, heads, d, seed=8), _queries(300, heads, d, seed=9), (1, 7, 64, 100),
               single=[(250, 262)])  # one call for a chunk across the first AMX position


@pytest.mark.parametrize("path", ["avx512", "avx2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_vector_path_agrees_with_the_portable_one(fmt, path, monkeypatch):
    if not (cpu_has_avx512() if path == "avx512" else cpu_has_avx2()):
        pytest.skip(f"no {path} path on this CPU")
    layout, attn, cache, tables = _case(fmt, 12, 3, 64, 16, [100])
    q = _queries(100, 12, 64, seed=4)
    if path == "avx2":
        monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx2")
    assert paged_prefill.isa() == path
    vec = attn.prefill(q, cache, tables, [0, 100], [0], 0.125)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "scalar")
    scalar = attn.prefill(q, cache, tables, [0, 100], [0], 0.125)
    torch.testing.assert_close(vec, scalar, rtol=1e-5, atol=1e-5)
    assert not torch.equal(vec, scalar)  # two real paths, not one twice


def test_mismatched_offsets_are_refused():
    _, attn, cache, tables = _case("int4", 4, 2, 64, 16, [20])
    with pytest.raises(ValueError, match="query offsets"):
        attn.prefill(_queries(20, 4, 64, 0), cache, tables, [0, 19], [0], 0.125)


def test_fresh_kv_prefill_over_lossy_pages_is_left_to_the_torch_path():
    # QServe's fresh-K/V prefill must not read rounded values back from the pages
    layout = page_layout("bfloat16", 2, 64, 16)
    _, cache, tables, _ = make_pages(4, 2, 64, [20], bs=16, num_blocks=4, layout=layout)
    q = _queries(20, 4, 64, 0)
    assert CpuAttention(layout, quantized_prefill=False).prefill(q, cache, tables, [0, 20], [0], 0.125) is None
    assert CpuAttention(layout, quantized_prefill=False).prefill(q.bfloat16(), cache, tables, [0, 20], [0],
                                                                 0.125) is not None  # exact pages
