"""Sliding-window attention in the attention kernels: a query at position p
sees positions p - window + 1 .. p (transformers' and llama.cpp's
definition). Each C path (decode: scalar, AVX2, AVX-512 fp32 and VNNI
scores; prefill: scalar, AVX2, AVX-512 and the AMX tiles) and the torch
reference against one fp64 reference written here (the Triton decode kernel
against it in tests/test_triton_attention.py), for every page format; pages
wholly before the window are never read; the prefill's chunking invariance
holds with a window."""
from __future__ import annotations

import pytest
import torch
from conftest import cpu_has_avx2, cpu_has_avx512, make_pages, page_layout
from test_paged_prefill import _invariant

from qoqserve.kernels.cpu import paged_decode, paged_prefill
from qoqserve.layers.attention_backends import AttentionBackend, CpuAttention

FORMATS = ["int4", "int8", "bfloat16", "float16", "float32"]
# one token, inside a page, across pages, past a 256-token chunk (several chunks, merged)
LENS = [1, 13, 50, 100, 301, 600]
# 1: only itself; 16 / 24: a page; 300 < 301 < 600: one and several chunks before the window
WINDOWS = [1, 7, 16, 24, 33, 300, 1000]


def _pages(fmt, heads, hkv, d, bs, lens, seed=0):
    layout = page_layout(fmt, hkv, d, bs)
    blocks = sum(-(-n // bs) for n in lens) + 3
    _, cache, tables, ctx = make_pages(heads, hkv, d, lens, bs=bs, num_blocks=blocks, seed=seed, layout=layout)
    return layout, cache, tables, ctx


def _reference(layout, q, cache, tables, positions, window, scale, softcap=0.0):
    """fp64 attention of each query row (at positions[i] of sequence i) over the
    keys p - window + 1 .. p of its pages, gathered by the layout's own read;
    softcap > 0: its scores s soft-capped to softcap * tanh(s / softcap)."""
    k_all, v_all = layout.read(cache, tables, torch.float64)  # [B, L, Hkv, D]
    outs = []
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        k, v = k_all[i, lo:p + 1], v_all[i, lo:p + 1]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        w = torch.softmax(torch.tanh(scores / softcap) * softcap if softcap else scores, -1)
        outs.append(torch.einsum("hl,lhd->hd", w, v))
    return torch.stack(outs).float()


@pytest.fixture(params=["vnni", "avx512", "avx2", "scalar"])
def decode_path(request, monkeypatch):
    """Every decode path of the C kernel this CPU has (vnni: AVX-512 with KV4
    scores by integer dot products; avx512: its fp32 scores)."""
    cpuinfo = open("/proc/cpuinfo").read()
    have = {"vnni": cpu_has_avx512() and "avx512_vnni" in cpuinfo, "avx512": cpu_has_avx512(),
            "avx2": cpu_has_avx2(), "scalar": True}[request.param]
    if not have:
        pytest.skip(f"no {request.param} path here")
    if request.param == "vnni":
        monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("QOQSERVE_CPU_ISA", request.param)
    assert paged_decode.isa() == ("avx512" if request.param == "vnni" else request.param)
    return request.param


@pytest.mark.parametrize("bs", [16, 24])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_sees_the_last_window_positions_on_every_path(fmt, bs, decode_path):
    heads, hkv, d = 9, 3, 64
    layout, cache, tables, ctx = _pages(fmt, heads, hkv, d, bs, LENS)
    attn = CpuAttention(layout)
    q = torch.randn(len(LENS), heads, d, generator=torch.Generator().manual_seed(1)) * 2
    for window in WINDOWS:
        got = attn.decode(q, cache, tables, ctx, d ** -0.5, window)
        ref = _reference(layout, q, cache, tables, [n - 1 for n in LENS], window, d ** -0.5)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"window {window}")
    # a window at least as long as every context is no window: the same bits
    whole = attn.decode(q, cache, tables, ctx, d ** -0.5)
    assert torch.equal(attn.decode(q, cache, tables, ctx, d ** -0.5, 600), whole)


@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_decode_of_other_shapes_and_the_bf16_entry(fmt, decode_path):
    # head_dim 80 / 128, one and eight query heads per KV head; bf16 queries
    # take the kernel's bf16 entry (widened and rounded inside it)
    for heads, hkv, d in [(8, 1, 80), (8, 2, 128), (4, 4, 64)]:
        layout, cache, tables, ctx = _pages(fmt, heads, hkv, d, 16, [40, 300])
        q = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(2))
        ref = _reference(layout, q, cache, tables, [39, 299], 37, d ** -0.5)
        attn = CpuAttention(layout)
        torch.testing.assert_close(attn.decode(q, cache, tables, ctx, d ** -0.5, 37), ref, rtol=1e-5, atol=1e-5)
        got16 = attn.decode(q.bfloat16(), cache, tables, ctx, d ** -0.5, 37)
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.float(), ref, rtol=2e-2, atol=2e-2)


def _poison_before(layout, cache, tables, b, before, bs):
    """NaN in every page of sequence b wholly before position `before` (KV4 /
    KV8 pages: all bits set, their scales NaN), which a kernel that reads them
    cannot hide."""
    k_rows, v_rows = layout.page_rows(cache)
    for page in tables[b, :before // bs].tolist():
        for rows in (k_rows, v_rows):
            view = rows[page * bs:(page + 1) * bs]
            view.fill_(0xFF if view.dtype == torch.uint8 else float("nan"))


@pytest.mark.parametrize("fmt", ["int4", "int8", "float32"])
def test_pages_before_the_window_are_never_read(fmt, decode_path):
    bs, window, lens = 16, 40, [600, 90]
    layout, cache, tables, ctx = _pages(fmt, 9, 3, 64, bs, lens)
    attn = CpuAttention(layout)
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3))
    clean, whole = attn.decode(q, cache, tables, ctx, 0.125, window), attn.decode(q, cache, tables, ctx, 0.125)
    for b, n in enumerate(lens):
        _poison_before(layout, cache, tables, b, n - window, bs)
    assert torch.equal(attn.decode(q, cache, tables, ctx, 0.125, window), clean)
    # without the window the kernel reads them: the poison shows
    assert not torch.equal(attn.decode(q, cache, tables, ctx, 0.125), whole)


def test_the_torch_paths_slide_too():
    # the portable backend (gather + fp64 SDPA) and its compiled variant: the reference for other devices
    layout, cache, tables, ctx = _pages("int4", 9, 3, 64, 16, [13, 301])
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    for window in (1, 20, 256):
        ref = _reference(layout, q, cache, tables, [12, 300], window, 0.125)
        torch.testing.assert_close(AttentionBackend(layout).decode(q, cache, tables, ctx, 0.125, window), ref,
                                   rtol=1e-5, atol=1e-5)


# ---- prefill ---------------------------------------------------------------------


def _prefill_case(fmt, heads, hkv, d, bs, lens, chunks, window, seed=0, softcap=0.0):
    """The last chunks[i] queries of sequences of lens[i] tokens in one call
    (softcap > 0: the scores soft-capped), held to the fp64 reference:
    (attention, pages, tables, q, starts, firsts, result)."""
    layout, cache, tables, _ = _pages(fmt, heads, hkv, d, bs, lens, seed=seed)
    attn = CpuAttention(layout, quantized_prefill=True)
    firsts = [n - c for n, c in zip(lens, chunks)]
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c)
    q = torch.randn(starts[-1], heads, d, generator=torch.Generator().manual_seed(seed + 1)) * 2
    got = attn.prefill(q, cache, tables, starts, firsts, d ** -0.5, window, softcap)
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(chunks))
    positions = [f + i for f, c in zip(firsts, chunks) for i in range(c)]
    ref = _reference(layout, q, cache, tables[rows], positions, window, d ** -0.5, softcap)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5, msg=f"window {window}")
    return attn, cache, tables, q, starts, firsts, got


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_sees_the_last_window_positions_on_every_path(fmt, isa):
    # whole prompts and chunks after a cached prefix, windows inside a tile
    # (16 / 48 / 64 keys), across several, and longer than every prompt
    for window in (1, 5, 16, 129, 1000):
        _prefill_case(fmt, 9, 3, 64, 16, [1, 40, 77, 130, 300], [1, 40, 9, 70, 150], window)


def test_amx_prefill_slides():
    start = paged_prefill.amx_from("int4", 64)
    if start is None:
        pytest.skip("no AMX-INT8 path for KV4 prefill on this CPU")
    lens, chunks = [start + 200, start + 333], [start + 200, 90]
    for window in (30, 200):  # inside a 64-key tile, across several
        _prefill_case("int4", 9, 3, 64, 16, lens, chunks, window, seed=5)


@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_a_windowed_query_does_not_depend_on_chunking_batch_or_threads(fmt, isa):
    # AMX included (positions past its first), where the CPU has it
    n, heads = 420, 9
    layout, cache, tables, _ = _pages(fmt, heads, 3, 64, 16, [n, 60], seed=6)

    class Windowed(CpuAttention):
        def prefill(self, q, cache, tables, starts, firsts, scale, window=0):
            return super().prefill(q, cache, tables, starts, firsts, scale, 45)

    def queries(t, seed):
        return torch.randn(t, heads, 64, generator=torch.Generator().manual_seed(seed)) * 2

    _invariant(Windowed(layout, quantized_prefill=True), cache, tables, queries(n, 7), queries(60, 8), (1, 7, 64, 100),
               single=[(250, 262), (300, 420)])


def test_prefill_tiles_wholly_before_the_window_are_never_read(isa):
    bs, window, n, chunk = 16, 40, 500, 64
    layout, cache, tables, _ = _pages("int4", 9, 3, 64, bs, [n])
    attn = CpuAttention(layout, quantized_prefill=True)
    q = torch.randn(chunk, 9, 64, generator=torch.Generator().manual_seed(9))
    first = n - chunk
    clean = attn.prefill(q, cache, tables, [0, chunk], [first], 0.125, window)
    # the first query's window starts at first - window + 1; its key tile (up to 64 keys) at most 63 before
    _poison_before(layout, cache, tables, 0, first - window + 1 - 64, bs)
    assert torch.equal(attn.prefill(q, cache, tables, [0, chunk], [first], 0.125, window), clean)
