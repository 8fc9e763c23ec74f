"""The LM head's kernels: the INT8 option (--lm-head-dtype int8) against a
per-channel fake-quant reference, its bytes, and its replay in a captured step."""
from __future__ import annotations

import gc

import pytest
import torch

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import int8_linear
from qoqserve.layers.logits import CpuLogitsHead, Int8LogitsHead
from qoqserve.layers.quantization.w8a8 import quantize_weight_per_channel
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)


def _fake_quant_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp64 of (per-token INT8 hidden) x (per-channel INT8 weight), each dequantized."""
    w_int8, scale = quantize_weight_per_channel(weight)
    x_q, s_a = qoq_ref.quantize_act_int8(hidden)
    return (x_q.double() * s_a.double()[:, None]) @ (w_int8.double() * scale.double()[:, None]).T


@pytest.mark.parametrize("fused", [True, False])
def test_int8_head_matches_the_fake_quant_reference(fused):
    if fused and not int8_linear.available():
        pytest.skip("no VNNI kernel here")
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(1000, 96, generator=g) * 0.05, torch.randn(7, 96, generator=g)
    head = Int8LogitsHead(fused=fused, cpu_ops=True)
    head.prepare(weight)
    got = head(hidden, weight)
    ref = _fake_quant_logits(hidden, weight)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    exact = hidden @ weight.T
    assert (got - exact).abs().max() > 1e-4  # really quantized, not the float head


def test_the_fused_and_torch_int8_heads_agree_bit_for_bit():
    if not int8_linear.available():
        pytest.skip("no VNNI kernel here")
    g = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(300, 64, generator=g), torch.randn(5, 64, generator=g)
    heads = [Int8LogitsHead(fused=f, cpu_ops=True) for f in (True, False)]
    for h in heads:
        h.prepare(weight)
    assert torch.equal(heads[0](hidden, weight), heads[1](hidden, weight))


def test_int8_head_holds_about_half_of_a_bf16_copy():
    weight = torch.randn(4096, 256).bfloat16().float()  # bf16 values: the float head keeps a bf16 copy
    bf16, int8 = CpuLogitsHead(), Int8LogitsHead(fused=int8_linear.available(), cpu_ops=True)
    bf16.prepare(weight)
    int8.prepare(weight)
    assert bf16.resident_bytes() == weight.numel() * 2
    assert weight.numel() <= int8.resident_bytes() <= 0.52 * bf16.resident_bytes()


def test_a_head_reads_its_own_copy_or_else_the_models_weight():
    from qoqserve.layers.logits import LogitsHead
    weight = torch.randn(4096, 256).bfloat16().float()
    bf16, int8, plain = CpuLogitsHead(), Int8LogitsHead(fused=int8_linear.available(), cpu_ops=True), LogitsHead()
    for head in (bf16, int8):
        head.prepare(weight)
        assert head.read_bytes(weight) == head.resident_bytes() > 0
    assert plain.read_bytes(weight) == weight.numel() * 4  # the model's fp32 weight itself


def test_an_engine_with_the_int8_head_replays_its_captured_steps(tmp_path):
    from test_quant_pipeline import tiny_source
    tiny_source("llama", tmp_path)
    path, prompts = str(tmp_path / "llama"), [[5 + i * 3 + j for j in range(6 + 4 * i)] for i in range(3)]
    runs = {}
    for name, kw in {"eager": {"enforce_eager": True}, "captured": {"capture_sizes": "1,2,4"},
                     "float": {}}.items():
        llm = LLM(path, kv_cache_gb=0.05, dtype="float32", lm_head_dtype=name if name == "float" else "int8", **kw)
        runs[name] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]
        runs[name + "_stats"] = llm.engine.stats()
        del llm
        gc.collect()
    assert runs["captured_stats"]["lm_head_kernel"].startswith("int8")
    from qoqserve.bench.decode import step_read_bytes
    stats = runs["captured_stats"]
    assert stats["lm_head_read_bytes"] == stats["lm_head_copy_bytes"] > 0
    assert step_read_bytes(stats, 2, 10.5) == (stats["linear_weight_bytes"] + stats["lm_head_read_bytes"]
                                               + 21 * stats["kv_bytes_per_token"])
    assert runs["captured_stats"]["captured_decode_sizes"] == [1, 2, 4]
    assert runs["captured"] == runs["eager"]
    assert runs["float"] != runs["eager"]  # the option changes the numbers: it ran


def test_auto_gives_qoq_checkpoints_the_int8_head_on_cpu_and_others_the_float_one():
    from qoqserve.engine.backends import logits_head
    from qoqserve.layers.quantization import KernelChoice
    from qoqserve.layers.quantization.fp import UnquantizedConfig
    from qoqserve.layers.quantization.qoq import QoQConfig
    from qoqserve.layers.quantization.w8a8 import W8A8Config
    cpu = KernelChoice(kernels="cpu", w4a8="packed")
    qoq, fp, w8a8 = QoQConfig(group_size=64, kv_bits=4), UnquantizedConfig(), W8A8Config()
    assert isinstance(logits_head("auto", cpu, True, torch.float32, qoq), Int8LogitsHead)
    for quant in (fp, w8a8):
        assert isinstance(logits_head("auto", cpu, True, torch.float32, quant), CpuLogitsHead)
    assert not isinstance(logits_head("float", cpu, True, torch.float32, qoq), Int8LogitsHead)
    assert isinstance(logits_head("int8", cpu, True, torch.float32, fp), Int8LogitsHead)
    with pytest.raises(ValueError, match="lm_head_dtype"):
        logits_head("fp8", cpu, True, torch.float32, qoq)


def test_the_int8_head_lets_the_model_release_its_float_lm_head(qoq_tiny, monkeypatch):
    # the head computes from its own INT8 copy: the model's untied fp32 lm_head
    # is never read again, so the serving runner frees it; outputs unchanged
    from qoqserve.models.llama import LlamaForCausalLM
    prompts = [[5 + i * 3 + j for j in range(6 + 4 * i)] for i in range(3)]
    llm = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32")
    model, stats = llm.engine.runner.model, llm.engine.stats()
    assert stats["lm_head_kernel"].startswith("int8") and model.lm_head.is_meta
    released = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]
    shape = model.lm_head.shape
    del llm
    gc.collect()
    monkeypatch.setattr(LlamaForCausalLM, "release_lm_head", lambda self: None)
    kept = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32")
    assert not kept.engine.runner.model.lm_head.is_meta
    assert kept.engine.stats()["weight_bytes"] - stats["weight_bytes"] == shape.numel() * 4
    assert [(o.token_ids, o.logprobs) for o in kept.generate(prompts, GREEDY)] == released
    float_head = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32", lm_head_dtype="float")
    assert not float_head.engine.runner.model.lm_head.is_meta  # the float head reads it
