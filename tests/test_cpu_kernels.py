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
    from qoqserve.layers.qoq_linear import int8_linear

    torch.manual_seed(2)
    for zeros in (None, torch.randint(0, 16, (48,), dtype=torch.uint8)):
        w = torch.randint(0, 16, (48, 64), dtype=torch.uint8) if zeros is not None else \
            torch.randint(-128, 128, (48, 64), dtype=torch.int8)
        s1 = (torch.rand(48) * 1e-2).half()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, 64).to(dtype)
            assert torch.equal(int8_linear(x, w, s1, zeros, None, True), int8_linear(x, w, s1, zeros, None, False))
