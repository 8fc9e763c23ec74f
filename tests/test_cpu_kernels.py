"""The C KV4 decode kernel (CPU path) against the torch paged path."""
from __future__ import annotations

import pytest
import torch

from qoqserve.kernels.cpu import kv4_decode
from qoqserve.layers.attention import AttentionMetadata, PagedAttention
from conftest import make_kv4_pages


def test_the_kernel_builds_here():
    assert kv4_decode.available()  # a compiler is part of the set-up; no silent fallback in CI


@pytest.mark.parametrize("heads,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 2, 80)])
def test_c_decode_attention_matches_the_torch_path(heads, hkv, d):
    lens = [1, 17, 50, 100]
    layout, cache, tables, ctx = make_kv4_pages(heads, hkv, d, lens)
    q = torch.randn(len(lens), heads, d)
    got = kv4_decode.kv4_decode_attention(q, cache, tables, ctx, d ** -0.5)
    attn = PagedAttention(heads, hkv, d, layout)
    ref = attn(q, None, None, AttentionMetadata(False, None, tables, ctx), cache).view(len(lens), heads, d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_c_decode_attention_of_a_sequence_does_not_depend_on_its_batch():
    lens = [33, 7, 120, 64, 5]
    _, cache, tables, ctx = make_kv4_pages(9, 3, 64, lens, seed=1)
    q = torch.randn(len(lens), 9, 64)
    batched = kv4_decode.kv4_decode_attention(q, cache, tables, ctx, 0.125)
    for i, n in enumerate(lens):
        width = -(-n // 16)
        alone = kv4_decode.kv4_decode_attention(q[i:i + 1], cache, tables[i:i + 1, :width], ctx[i:i + 1], 0.125)
        assert torch.equal(alone[0], batched[i])


def test_bf16_queries_come_back_in_bf16():
    layout, cache, tables, ctx = make_kv4_pages(4, 2, 64, [10, 20])
    q = torch.randn(2, 4, 64).bfloat16()
    out = kv4_decode.kv4_decode_attention(q, cache, tables, ctx, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
