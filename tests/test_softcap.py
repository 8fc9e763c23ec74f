"""Logit soft-capping (Gemma 2): each attention score s becomes
cap * tanh(s / cap) before the softmax, and the final logits likewise.
Every attention path (C decode: scalar, AVX2, AVX-512 fp32 and VNNI scores,
the bf16 entry; C prefill: scalar, AVX2, AVX-512, AMX tiles; the torch
paths) against the fp64 reference of tests/test_sliding_window_kernels.py
with the cap; the Triton decode kernel in tests/test_triton_attention.py;
the logits' C kernel against torch's; the quantizer's KL loss through the
cap against autograd."""
from __future__ import annotations

import pytest
import torch
from test_sliding_window_kernels import _pages, _prefill_case, _reference, decode_path  # noqa: F401

from qoqserve.kernels.cpu import elementwise, paged_prefill
from qoqserve.layers.attention import AttentionMetadata, PagedAttention
from qoqserve.layers.attention_backends import AttentionBackend, CpuAttention
from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps

# small enough that the cap changes the outputs far past the tolerance: the
# scores here reach about +-8 (queries times 2, head_dim 64)
CAP = 3.0
LENS = [1, 13, 50, 301, 600]


@pytest.mark.parametrize("fmt", ["int4", "int8", "bfloat16", "float32"])
def test_decode_caps_the_scores_on_every_path(fmt, decode_path):  # noqa: F811
    heads, hkv, d = 9, 3, 64
    layout, cache, tables, ctx = _pages(fmt, heads, hkv, d, 16, LENS)
    attn = CpuAttention(layout)
    q = torch.randn(len(LENS), heads, d, generator=torch.Generator().manual_seed(1)) * 2
    last = [n - 1 for n in LENS]
    for window in (0, 33):
        got = attn.decode(q, cache, tables, ctx, d ** -0.5, window, CAP)
        torch.testing.assert_close(got, _reference(layout, q, cache, tables, last, window, d ** -0.5, CAP),
                                   rtol=1e-5, atol=1e-5, msg=f"window {window}")
    uncapped = _reference(layout, q, cache, tables, last, 0, d ** -0.5)
    assert (attn.decode(q, cache, tables, ctx, d ** -0.5, 0, CAP) - uncapped).abs().max() > 1e-2
    # the bf16 entry (a bf16 model's step) takes the cap too
    got16 = attn.decode(q.bfloat16(), cache, tables, ctx, d ** -0.5, 0, CAP)
    torch.testing.assert_close(got16.float(), _reference(layout, q.bfloat16().float(), cache, tables, last, 0,
                                                         d ** -0.5, CAP), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", ["int4", "bfloat16", "float32"])
def test_prefill_caps_the_scores_on_every_path(fmt, isa):
    # whole prompts and chunks after a cached prefix, with and without a window
    for window in (0, 45):
        attn, cache, tables, q, starts, firsts, got = _prefill_case(fmt, 9, 3, 64, 16, [1, 40, 130, 300],
                                                                    [1, 40, 70, 150], window, softcap=CAP)
        assert (got - attn.prefill(q, cache, tables, starts, firsts, 64 ** -0.5, window)).abs().max() > 1e-2


def test_amx_prefill_caps_the_scores():
    start = paged_prefill.amx_from("int4", 64)
    if start is None:
        pytest.skip("no AMX-INT8 path for KV4 prefill on this CPU")
    for window in (0, 200):
        _prefill_case("int4", 9, 3, 64, 16, [start + 200, start + 333], [start + 200, 90], window, seed=5,
                      softcap=CAP)


def test_the_torch_paths_cap_the_scores():
    # the portable backend's decode (gather + fp64 attention), its compiled
    # variant's math, and the attention layer's own prefill (the quantizer's
    # and the simulation's path): each against the reference
    heads, hkv, d, lens = 9, 3, 64, [13, 301]
    layout, cache, tables, ctx = _pages("int4", heads, hkv, d, 16, lens)
    q = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(4)) * 2
    for window in (0, 20):
        ref = _reference(layout, q, cache, tables, [12, 300], window, 0.125, CAP)
        torch.testing.assert_close(AttentionBackend(layout).decode(q, cache, tables, ctx, 0.125, window, CAP), ref,
                                   rtol=1e-5, atol=1e-5)
        from qoqserve.layers.attention_backends import decode_attention
        torch.testing.assert_close(decode_attention(layout, cache, tables, ctx, q, 0.125, heads, window, CAP), ref,
                                   rtol=1e-5, atol=1e-5)
    # a prompt of 40 tokens over dense fp32 pages (KV4 ones would fake-quantize its K/V)
    n, layout = 40, _pages("float32", heads, hkv, d, 16, [1])[0]
    qs, ks, vs = (torch.randn(n, h, d, generator=torch.Generator().manual_seed(s)) * 2
                  for s, h in ((5, heads), (6, hkv), (7, hkv)))
    attn = PagedAttention(heads, hkv, d, AttentionBackend(layout), window=17, softcap=CAP)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=None, block_tables=None, context_lens=None,
                             query_starts=[0, n], cached_lens=[0])
    got = attn(qs, ks, vs, meta, None).view(n, heads, d)
    rep = heads // hkv
    scores = torch.einsum("qhd,khd->hqk", qs.double(), ks.double().repeat_interleave(rep, 1)) * d ** -0.5
    pos = torch.arange(n)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 17)
    w = torch.softmax((torch.tanh(scores / CAP) * CAP).masked_fill(~seen, float("-inf")), -1)
    want = torch.einsum("hqk,khd->qhd", w, vs.double().repeat_interleave(rep, 1)).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_logits_cap_in_c_as_in_torch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 70_001, generator=g) * 40  # past the cap both ways; an odd width
    logits[1, 7], logits[2, 9] = float("nan"), float("inf")
    got, want = CpuTokenOps().softcap(logits, 30.0), TorchTokenOps().softcap(logits, 30.0)
    assert got.isnan()[1, 7] and got[2, 9] == 30.0
    finite = ~want.isnan()
    torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=2e-7 * 30)
    assert torch.equal(elementwise.softcap(logits[:1], 30.0), got[:1])  # one row: the same bits


def test_head_kl_through_the_cap_is_the_kl_of_the_capped_logits():
    from test_scale_tuning import kl_to_reference

    from qoqserve.quant.ste import HeadKL
    torch.manual_seed(0)
    h, h_ref = torch.randn(70, 32, requires_grad=True), torch.randn(70, 32)
    head = torch.randn(1000, 32) * 2  # logits up to ~+-40: the cap matters
    head_ref = head + 0.05 * torch.randn_like(head)
    cap = 10.0
    loss = HeadKL.apply(h, h_ref, head, head_ref, head.clone(), torch.empty(3, 16, 1000), cap)
    loss.backward()
    got, h.grad = h.grad.clone(), None
    want = kl_to_reference(torch.log_softmax(torch.tanh(h_ref @ head_ref.T / cap) * cap, -1),
                           torch.tanh(h @ head.T / cap) * cap)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, h.grad, rtol=0, atol=1e-5 * h.grad.abs().max().item())
    plain = HeadKL.apply(h.detach(), h_ref, head, head_ref, head.clone(), torch.empty(3, 16, 1000))
    assert abs(float(plain) - float(loss.detach())) > 1e-2
