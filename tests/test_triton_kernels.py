"""Every Triton kernel against its torch reference, on CPU in Triton's
interpreter (TRITON_INTERPRET=1, set in conftest). On a GPU machine,
QOQSERVE_TEST_DEVICE=cuda TRITON_INTERPRET=0 runs the same checks compiled
(scripts/gpu_check.sh); references are always computed on CPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.triton.act_quant import quant_int8, rmsnorm_quant, silu_mul_quant
from qoqserve.kernels.triton.w4a8_gemm import block_k, split_k_for, tile_for, w4a8_gemm
from qoqserve.layers.norm import RMSNorm

DEVICE = os.environ.get("QOQSERVE_TEST_DEVICE", "cpu")


def on_device(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


def _weights(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 3] *= 8  # an outlier input channel
    if group:
        q = qoq_ref.quantize_weight_group(w, group)
        return dict(qweight=qoq_ref.pack_uint4(q.u), s1=q.s1.half(), s2=q.s2, zeros=q.z), q
    q = qoq_ref.quantize_weight_channel(w)
    return dict(qweight=qoq_ref.pack_uint4(q.u), s1=q.s1.half(), zeros=q.z), q


@pytest.mark.parametrize("group,m", [(g, m) for g in (0, 64, 128) for m in (1, 7, 33, 130, 300)]
                         + [(32, 1), (32, 33), (32, 300), (256, 7), (256, 130)])
def test_w4a8_gemm_accumulator_is_bit_exact_and_epilogue_matches(group, m):
    n, k = 96, 512  # N not a multiple of any tile width
    p, q = _weights(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 2
    x_q, s_a = qoq_ref.quantize_act_int8(x)
    rowsum = qoq_ref.act_row_sum(x)
    w_int8 = qoq_ref.group_weight_to_int8(q) if group else q.u.to(torch.int8)
    args = on_device(x_q, s_a, p["qweight"], p["s1"], p["zeros"], p.get("s2"))
    rs, = on_device(rowsum)
    acc = w4a8_gemm(*args, group, rs, return_acc=True).cpu()
    assert torch.equal(acc, qoq_ref.int8_mm(x_q, w_int8))
    y = w4a8_gemm(*args, group, rs, out_dtype=torch.float32).cpu()
    ref = _reference(x, q, p, group)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def _reference(x, q, p, group):
    if group:
        return qoq_ref.w4a8_group_linear(x, qoq_ref.group_weight_to_int8(q), p["s1"])
    return qoq_ref.w4a8_channel_linear(x, q.u, p["s1"], p["zeros"])


@pytest.mark.parametrize("group,split", [(0, 3), (64, 2), (128, 4)])
def test_w4a8_gemm_split_k_sums_exactly(group, split):
    """Split K: partial INT32 sums added atomically, then the epilogue kernel."""
    n, k, m = 80, 1024, 5
    p, q = _weights(n, k, group, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    x_q, s_a = qoq_ref.quantize_act_int8(x)
    w_int8 = qoq_ref.group_weight_to_int8(q) if group else q.u.to(torch.int8)
    args = on_device(x_q, s_a, p["qweight"], p["s1"], p["zeros"], p.get("s2"))
    rs, bias = on_device(qoq_ref.act_row_sum(x), torch.randn(n))
    acc = w4a8_gemm(*args, group, rs, return_acc=True, split_k=split).cpu()
    assert torch.equal(acc, qoq_ref.int8_mm(x_q, w_int8))
    y = w4a8_gemm(*args, group, rs, bias=bias, out_dtype=torch.float32, split_k=split).cpu()
    ref = _reference(x, q, p, group) + bias.cpu()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_split_k_is_chosen_only_where_the_grid_underfills_the_gpu():
    decode = tile_for(1)
    bk = block_k(decode, 128)
    assert split_k_for(1, 4096, 14336, decode, bk, 132) > 1      # down_proj at decode
    assert split_k_for(1, 4096, 256, decode, bk, 132) == 1       # too few K steps to share
    assert split_k_for(4096, 4096, 14336, tile_for(4096), bk, 132) == 1


@pytest.mark.parametrize("group", [16, 48, 96])
def test_w4a8_gemm_refuses_group_sizes_it_cannot_serve(group):
    n, k = 64, 192 * 2
    x_q = torch.zeros(2, k, dtype=torch.int8)
    ng = k // group
    with pytest.raises(ValueError, match="group size"):
        w4a8_gemm(*on_device(x_q, torch.ones(2), torch.zeros(n, k // 2, dtype=torch.uint8),
                             torch.ones(n).half(), torch.zeros(n, ng, dtype=torch.uint8),
                             torch.ones(n, ng, dtype=torch.uint8)), group)


def test_w4a8_gemm_validates_its_inputs():
    p, _ = _weights(64, 128, 64)
    x_q, s_a = qoq_ref.quantize_act_int8(torch.randn(3, 128))
    good = dict(x_q=x_q, s_a=s_a, qweight=p["qweight"], s1=p["s1"], zeros=p["zeros"], s2=p["s2"])
    bad = [("qweight", p["qweight"].t().contiguous().t()), ("s1", p["s1"].double()),
           ("zeros", p["zeros"][:, :1]), ("x_q", x_q.float())]
    for name, value in bad:
        kw = {**good, name: value}
        with pytest.raises(ValueError):
            w4a8_gemm(*on_device(*kw.values()), 64)


def test_w4a8_gemm_bias_and_fp16_output():
    p, q = _weights(64, 128, 64)
    x = torch.randn(5, 128)
    x_q, s_a = qoq_ref.quantize_act_int8(x)
    bias = torch.randn(64).half()
    y = w4a8_gemm(*on_device(x_q, s_a, p["qweight"], p["s1"], p["zeros"], p["s2"]), 64,
                  bias=bias.to(DEVICE)).cpu()
    ref = qoq_ref.w4a8_group_linear(x, qoq_ref.group_weight_to_int8(q), p["s1"]) + bias.float()
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref, rtol=1e-3, atol=1e-3)


def _assert_quantized_like(got, ref_input):
    q, s, rs = (t.cpu() for t in got)
    _, ref_s = qoq_ref.quantize_act_int8(ref_input)
    half = ref_input.dtype in (torch.float16, torch.bfloat16)
    # In half precision the row's largest element may round one ulp apart when
    # the kernel's exp / sqrt differ from torch's in the last fp32 bit (on a
    # GPU they compile to approximate instructions): then the scale moves by
    # that ulp, and the codes must follow the kernel's own scale.
    eps = torch.finfo(ref_input.dtype).eps if half else 0.0
    torch.testing.assert_close(s, ref_s, rtol=1e-6 + eps, atol=0)
    own_q = torch.clamp(torch.round(ref_input.float() / s[:, None]), -127, 127)
    diff = (q.int() - own_q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # rounding-boundary ties only
    # a sum of K terms in another order (relative to the sum of magnitudes), plus,
    # in half precision, an element or two landing one ulp apart
    scale = ref_input.float().abs().sum(-1).max().item()
    ulps = 2 * torch.finfo(ref_input.dtype).eps * ref_input.float().abs().max().item()
    torch.testing.assert_close(rs, qoq_ref.act_row_sum(ref_input), rtol=0, atol=1e-6 * scale + ulps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [64, 576])
def test_rmsnorm_quant_matches_rmsnorm_then_quantize(dtype, k):
    norm = RMSNorm(k, 1e-5, dtype)
    norm.weight.data = (torch.rand(k) + 0.5).to(dtype)
    x = (torch.randn(9, k) * 3).to(dtype)
    _assert_quantized_like(rmsnorm_quant(*on_device(x, norm.weight), norm.eps), norm(x))


@pytest.mark.parametrize("dtype,max_block", [(torch.float32, None), (torch.float16, None),
                                             (torch.float16, 64)])
def test_silu_mul_quant_matches_torch(dtype, max_block):
    """max_block 64: the two-pass path of rows too long for one block (3 chunks)."""
    gate_up = (torch.randn(6, 2 * 192) * 2).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    kw = {"max_block": max_block} if max_block else {}
    _assert_quantized_like(silu_mul_quant(gate_up.to(DEVICE), **kw), F.silu(gate) * up)


def test_quant_int8_is_exact():
    x = torch.randn(11, 100) * 5
    x[3] = 0  # an all-zero row gets scale 1
    q, s, rs = (t.cpu() for t in quant_int8(x.to(DEVICE)))
    ref_q, ref_s = qoq_ref.quantize_act_int8(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
    torch.testing.assert_close(rs, qoq_ref.act_row_sum(x))


# ---- the engine on the Triton path (interpreted) vs the torch path ----------

@pytest.fixture(scope="module")
def g64_checkpoint(tmp_path_factory):
    from test_quant_pipeline import calib, tiny_source

    from qoqserve.quant.checkpoint import save_checkpoint
    from qoqserve.quant.config import get_preset
    from qoqserve.quant.pipeline import quantize_model

    tmp = tmp_path_factory.mktemp("triton")
    source = tiny_source("llama", tmp)
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64)
    result = quantize_model(source, cfg, calib(), progress=False)
    out = str(tmp / "ckpt")
    save_checkpoint(result, source, calib(), out)
    return out


def test_engine_on_triton_kernels_matches_the_torch_path(g64_checkpoint):
    from qoqserve.llm import LLM
    from qoqserve.sampling_params import SamplingParams

    prompts = [[1, 5, 9, 200, 33, 7], [4, 4, 100, 17], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    runs = {}
    for kernels in ("torch", "triton"):
        device = DEVICE if kernels == "triton" else "cpu"
        llm = LLM(g64_checkpoint, dtype="float32", kernels=kernels, num_blocks=32, device=device)
        stats = llm.engine.stats()
        assert stats["kv_kernel"] == kernels and stats["kv_layout"] == "int4"
        assert all(p.endswith("/triton" if kernels == "triton" else "/torch-int8")
                   for p in stats["linear_paths"]), stats["linear_paths"]
        runs[kernels] = llm.generate(prompts, params)
        if kernels == "triton":  # packed codes stay resident: <= 0.6 byte per weight
            from qoqserve.layers.linear import Linear
            model = llm.engine.runner.model
            params_n = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear))
            assert stats["linear_weight_bytes"] / params_n <= 0.6
    for ref, got in zip(runs["torch"], runs["triton"]):
        # the INT32 accumulators are identical; the fused norm/activation
        # quantization and fp32 attention may move a logit in its last bits
        assert got.token_ids == ref.token_ids
        assert got.logprobs == pytest.approx(ref.logprobs, abs=2e-3)
