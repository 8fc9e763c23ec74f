"""The KV4 page write and the paged decode attention kernels against the torch
paged path, on CPU in Triton's interpreter (on a GPU machine compiled, as
tests/test_triton_kernels.py; scripts/gpu_check.sh)."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import make_pages

from qoqserve.kernels.triton.kv4_attention import kv4_decode_attention, kv4_write
from qoqserve.kernels.triton.paged_decode import fp16_paged_decode_attention, num_splits
from qoqserve.layers.attention import AttentionMetadata, PagedAttention
from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout, Int4KVCacheLayout

DEVICE = os.environ.get("QOQSERVE_TEST_DEVICE", "cpu")
# K/V tiles, queries and probabilities enter the tensor cores in fp16 (fp32
# accumulation): 2^-11 relative per operand, against the reference in fp32;
# plus one fp16 ulp of the (fp16) output itself, which both sides round to
ATOL = 2e-3
RTOL = 2.0 ** -10


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("hkv,d", [(2, 64), (1, 128), (3, 80)])
def test_kv4_write_is_byte_identical_to_the_torch_layout(hkv, d):
    layout = Int4KVCacheLayout(hkv, d, 16)
    ref, got = layout.allocate(6, "cpu"), layout.allocate(6, "cpu")
    k, v = torch.randn(21, hkv, d) * 2, torch.randn(21, hkv, d)
    k[4, 0] = 0.5  # a constant head (scale floor)
    slots = torch.randperm(6 * 16)[:21]
    layout.write(ref, k, v, slots)
    got, = on_device(got)
    kv4_write(got, *on_device(k, v, slots))
    assert torch.equal(got.cpu(), ref)


def test_kv4_write_skips_negative_slots():
    """Padded tokens (slot -1) leave the pool untouched."""
    layout = Int4KVCacheLayout(2, 64, 16)
    ref, got = layout.allocate(2, "cpu"), layout.allocate(2, "cpu")
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([3, -1, 7, -1, 20])
    keep = slots >= 0
    layout.write(ref, k[keep], v[keep], slots[keep])
    got, = on_device(got)
    kv4_write(got, *on_device(k, v, slots))
    assert torch.equal(got.cpu(), ref)


def _torch_decode(layout, heads, hkv, d, q, cache, tables, ctx):
    attn = PagedAttention(heads, hkv, d, AttentionBackend(layout))
    meta = AttentionMetadata(is_prefill=False, slot_mapping=None, block_tables=tables, context_lens=ctx)
    return attn(q, None, None, meta, cache).view(q.shape[0], heads, d)


# (8, 2, 36): rows not 4-byte aligned, so the byte-load path; the others load
# words. fp16 queries take the tensor-core path (fp16 operands, fp32 sums);
# fp32 queries keep exact fp32 dots and must match much closer.
CASES = [(6, 2, 64), (4, 4, 128), (8, 2, 80), (8, 2, 36)]


@pytest.mark.parametrize("heads,hkv,d,splits,dtype",
                         [(*c, s, torch.float16) for c in CASES for s in (1, 3)]
                         + [(6, 2, 64, 1, torch.float32), (4, 4, 128, 3, torch.float32)])
def test_kv4_decode_attention_matches_the_torch_path(heads, hkv, d, splits, dtype):
    lens = [1, 17, 50, 100]  # ragged, one shorter than a page; pages scattered over the pool
    layout, cache, tables, ctx = make_pages(heads, hkv, d, lens, num_blocks=40)
    q = torch.randn(len(lens), heads, d).to(dtype)
    got = kv4_decode_attention(*on_device(q, cache, tables, ctx), d ** -0.5, block_n=32,
                               splits=splits).cpu()
    ref = _torch_decode(layout, heads, hkv, d, q, cache, tables, ctx)
    assert got.dtype == dtype
    tol = ATOL if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), rtol=RTOL if dtype == torch.float16 else 0,
                               atol=tol)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_of_an_empty_context_is_zero_not_nan(splits):
    """A padded batch slot (context 0) must not poison the batch with NaN."""
    heads, hkv, d = 4, 2, 64
    layout, cache, tables, ctx = make_pages(heads, hkv, d, [40, 40], num_blocks=8)
    ctx = torch.tensor([40, 0])
    q = torch.randn(2, heads, d).half()
    got = kv4_decode_attention(*on_device(q, cache, tables, ctx), d ** -0.5, block_n=32,
                               splits=splits).cpu()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    ref = _torch_decode(layout, heads, hkv, d, q[:1], cache, tables[:1], ctx[:1])
    torch.testing.assert_close(got[:1].float(), ref.float(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("heads,hkv", [(8, 2), (2, 2)])
def test_fp16_paged_variant_matches_the_torch_path(heads, hkv):
    d = 64
    layout = DenseKVCacheLayout(hkv, d, 16, torch.float16)
    layout, cache, tables, ctx = make_pages(heads, hkv, d, [5, 33, 70], num_blocks=16, layout=layout)
    q = torch.randn(3, heads, d).half()
    got = fp16_paged_decode_attention(*on_device(q, cache, tables, ctx), d ** -0.5, block_n=32,
                                      splits=2).cpu()
    ref = _torch_decode(layout, heads, hkv, d, q, cache, tables, ctx)
    torch.testing.assert_close(got.float(), ref.float(), rtol=RTOL, atol=ATOL)


def test_context_splits_only_where_the_batch_underfills_the_gpu():
    assert num_splits(1, 8, 4096, 132) > 1
    assert num_splits(64, 8, 4096, 132) == 1
    assert num_splits(1, 8, 128, 132) == 1  # too short to be worth a merge


def test_decode_validates_its_inputs():
    _, cache, tables, ctx = make_pages(4, 2, 64, [10, 20], num_blocks=8)
    q = torch.randn(2, 4, 64)
    bad = [(q, cache, tables.t().contiguous().t(), ctx),        # block table columns strided
           (q, cache, tables, ctx.float()),
           (q, cache.view(torch.int8), tables, ctx),
           (torch.randn(2, 3, 64), cache, tables, ctx)]           # 3 heads over 2 KV heads
    for args in bad:
        with pytest.raises(ValueError):
            kv4_decode_attention(*on_device(*args), 0.125)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_a_sliding_window_sees_the_last_window_positions(splits):
    from test_sliding_window_kernels import _reference
    heads, hkv, d, lens = 8, 2, 64, [13, 150]
    layout = Int4KVCacheLayout(hkv, d, 16)
    _, cache, tables, ctx = make_pages(heads, hkv, d, lens, num_blocks=16, seed=10, layout=layout)
    q = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(11))
    for window in (1, 20, 100, 400):
        got = kv4_decode_attention(*on_device(q, cache, tables, ctx), d ** -0.5, window, block_n=32,
                                   splits=splits).cpu()
        ref = _reference(layout, q, cache, tables, [n - 1 for n in lens], window, d ** -0.5)
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=f"window {window}")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads", [8, 2])  # a dot of 4 query heads per KV head; one each (multiply and reduce)
def test_decode_soft_caps_the_scores(splits, heads):
    from test_sliding_window_kernels import _reference
    hkv, d, lens, cap = 2, 64, [13, 150], 3.0
    layout = Int4KVCacheLayout(hkv, d, 16)
    _, cache, tables, ctx = make_pages(heads, hkv, d, lens, num_blocks=16, seed=12, layout=layout)
    q = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(13)) * 2
    for window in (0, 20):
        got = kv4_decode_attention(*on_device(q, cache, tables, ctx), d ** -0.5, window, cap, block_n=32,
                                   splits=splits).cpu()
        ref = _reference(layout, q, cache, tables, [n - 1 for n in lens], window, d ** -0.5, cap)
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=f"window {window}")
        plain = _reference(layout, q, cache, tables, [n - 1 for n in lens], window, d ** -0.5)
        assert (got - plain).abs().max() > 10 * ATOL
