"""End-to-end scale tuning (quant/scale_tuning.py) on tiny random models: it
lowers the KL to the FP model on the windows it trains, moves only the
float scales (every integer code and group parameter stays), leaves the
model's methods and layouts as they were, and reaches the checkpoint
through the config, the CLI and the runtime."""
import argparse
import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from test_quant_pipeline import _full, calib, tiny_source

from qoqserve.cli.quantize import add_quant_args, quant_config_from_args
from qoqserve.config import CacheConfig, EngineConfig
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.layers.kv_cache import Int4KVCacheLayout
from qoqserve.layers.linear import Linear
from qoqserve.layers.norm import RMSNorm
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, fused_int8_available
from qoqserve.layers.quantization.qoq_methods import QoQSimMethod
from qoqserve.model_loader import load_model_source
from qoqserve.quant import sim
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model, quantize_model
from qoqserve.quant.scale_tuning import _IntegerProduct, spread_windows, tune_scales
from qoqserve.quant.ste import HeadKL, KVFakeQuant, act_int8

WINDOWS = calib(4, 64).samples


def _fp(source, cfg):
    return build_fp_model(source, dataclasses.replace(cfg, w_bits=16, a_bits=16, kv_bits=16, scale_tuning_epochs=0),
                          "cpu")


def _kl(model, teacher, windows) -> float:
    """Mean KL(P_FP || P_model) per token over windows, the reference simulation."""
    total = 0.0
    for ids in windows:
        ref = torch.log_softmax(_full(teacher, ids).float(), -1)
        lp = torch.log_softmax(_full(model, ids).float(), -1)
        total += float((ref.exp() * (ref - lp)).sum(-1).mean())
    return total / len(windows)


@pytest.fixture(scope="module", params=[("llama", "g64"), ("qwen2", "chn")])
def case(request, tmp_path_factory):
    kind, preset = request.param
    source = tiny_source(kind, tmp_path_factory.mktemp("tune"))
    cfg = get_preset(preset, calib_samples=4, calib_seq_len=64)
    return source, cfg, quantize_model(source, cfg, calib(4), progress=False).model


def _integer_state(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if not t.is_floating_point() or n.endswith(("w_expanded", ".s2"))}


def test_tuning_lowers_kl_and_moves_only_float_scales(case):
    source, cfg, quantized = case
    model, teacher = copy.deepcopy(quantized), _fp(source, cfg)
    before_codes = _integer_state(model)
    before_s1 = {n: p.clone() for n, p in model.named_parameters() if n.endswith(".s1")}
    before_norms = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    start = _kl(model, teacher, WINDOWS)
    result = tune_scales(model, teacher, WINDOWS, epochs=6, lr=3e-3, seed=0)
    end = _kl(model, teacher, WINDOWS)
    assert len(result.curve) == 6 * len(WINDOWS) and result.tuned > 0
    assert end < start * 0.9, (start, end)
    after_codes = _integer_state(model)
    assert before_codes.keys() == after_codes.keys() and before_codes
    for name, t in before_codes.items():
        assert torch.equal(t, after_codes[name]), name
    params = dict(model.named_parameters())
    moved = [n for n, s1 in before_s1.items() if not torch.equal(s1, params[n])]
    assert len(moved) == len(before_s1) and all(params[n].dtype == torch.float16 for n in moved)
    norms = dict(model.named_modules())
    assert all(isinstance(norms[n].weight, torch.nn.Parameter) and not torch.equal(w, norms[n].weight)
               for n, w in before_norms.items())
    # the training's methods and layouts are gone again
    assert all(type(m.method) is QoQSimMethod for m in model.modules() if isinstance(m, Linear))
    assert all(isinstance(layer.self_attn.attn.layout, Int4KVCacheLayout) for layer in model.layers)


def test_tune_norms_off_leaves_the_norm_weights(case):
    source, cfg, quantized = case
    model = copy.deepcopy(quantized)
    before = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    tune_scales(model, _fp(source, cfg), WINDOWS[:2], epochs=1, lr=5e-3, tune_norms=False)
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            assert torch.equal(module.weight, before[name])


def test_linears_kept_at_w8a8_pass_gradients_and_stay(tmp_path):
    # the mixed recipe: layer 0's linears at W8A8 run their own numbers in the loop
    # (gradients reach layer 0's norms through them) and are not tuned
    source = tiny_source("llama", tmp_path)
    cfg = get_preset("g64", calib_samples=4, calib_seq_len=64, w8a8_linears=("layers.0.*",))
    model = quantize_model(source, cfg, calib(4), progress=False).model
    w8a8 = {n: t.clone() for n, t in model.layers[0].named_parameters()}
    norm = model.layers[0].input_layernorm.weight.clone()
    tune_scales(model, _fp(source, cfg), WINDOWS[:2], epochs=2, lr=5e-3)
    for name, t in model.layers[0].named_parameters():
        if "layernorm" not in name:
            assert torch.equal(t, w8a8[name]), name
    assert not torch.equal(model.layers[0].input_layernorm.weight, norm)


def test_tuned_checkpoint_through_cli_and_runtime(tmp_path):
    source = tiny_source("llama", tmp_path / "src")
    p = argparse.ArgumentParser()
    add_quant_args(p)
    cfg = quant_config_from_args(p.parse_args(["--scale-tuning-epochs", "1", "--scale-tuning-lr", "0.01",
                                               "--no-scale-tuning-norms", "--calib-samples", "4",
                                               "--calib-seq-len", "64"]))
    assert (cfg.scale_tuning_epochs, cfg.scale_tuning_lr, cfg.scale_tuning_norms) == (1, 0.01, False)
    assert cfg.scale_tuning_windows == 20  # the preset's; the 4 windows given are fewer: all of them
    result = quantize_model(source, cfg, calib(4), progress=False)
    assert "scale-tuning" in result.steps and len(result.scale_tuning.curve) == 4
    out = tmp_path / "ckpt"
    save_checkpoint(result, source, calib(4), str(out))
    stored = json.loads((out / "quant_config.json").read_text())
    assert stored["config"]["scale_tuning_epochs"] == 1 and "scale-tuning" in stored["steps"]
    loaded = load_model_source(str(out))
    engine_cfg = EngineConfig(model=str(out), dtype="float32", w4a8_backend="sim", kernels="torch",
                              cache=CacheConfig(num_blocks=8, quantized_prefill=True))
    runner = ModelRunner(engine_cfg, loaded.arch, loaded.iter_tensors(), 512, loaded.quant_config)
    ids = calib(1, 96, seed=5).samples[0]
    q = _full(result.model, ids)
    # the tuned s1 are stored as they were trained (fp16); what differs is the
    # fp16 storage of embeddings and lm_head, as for any checkpoint
    torch.testing.assert_close(_full(runner.model, ids), q, atol=2e-2 * q.abs().max().item(), rtol=0)


def test_scale_tuning_needs_a_qoq_format():
    with pytest.raises(ValueError, match="scale tuning"):
        get_preset("rtn-w8a8", scale_tuning_epochs=1)
    with pytest.raises(ValueError, match="scale_tuning"):
        get_preset("g64", scale_tuning_epochs=-1)


def test_a_refused_model_is_left_as_it_was(case):
    # a linear that is neither QoQ nor W8A8 after others were already swapped:
    # the refusal puts every swapped method back
    source, cfg, quantized = case
    model = copy.deepcopy(quantized)
    last = model.layers[-1].mlp.down_proj
    last.method = type("Other", (QoQSimMethod,), {})(last.method.group_size)
    methods = {n: m.method for n, m in model.named_modules() if isinstance(m, Linear)}
    with pytest.raises(ValueError, match="scale tuning runs on QoQ simulation models"):
        tune_scales(model, _fp(source, cfg), WINDOWS[:1], epochs=1, lr=1e-3)
    assert {n: m.method for n, m in model.named_modules() if isinstance(m, Linear)} == methods


def kl_to_reference(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean per-token KL(P_FP || P_model), the plain formula."""
    return (ref_logprobs.exp() * (ref_logprobs - torch.log_softmax(logits, -1))).sum(-1).mean()


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_head_kl_is_the_kl_of_the_logits_and_its_gradient(grad_dtype):
    # blocks of 16 rows over 70 tokens (a short last block); the gradient's
    # product in bf16 matches autograd's to bf16's rounding, in fp32 to fp32's
    torch.manual_seed(0)
    h, h_ref = torch.randn(70, 32, requires_grad=True), torch.randn(70, 32)
    head = torch.randn(1000, 32)
    head_ref = head + 0.05 * torch.randn_like(head)
    loss = HeadKL.apply(h, h_ref, head, head_ref, head.to(grad_dtype), torch.empty(3, 16, 1000))
    (2 * loss).backward()
    got, h.grad = h.grad.clone(), None
    want = kl_to_reference(torch.log_softmax(h_ref @ head_ref.T, -1), h @ head.T)
    (2 * want).backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    tol = 1e-2 if grad_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, h.grad, rtol=0, atol=tol * h.grad.abs().max().item())
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("fused, grad_dtype", [(True, torch.bfloat16), (False, torch.bfloat16),
                                              (True, torch.float32)])
def test_integer_product_is_act_int8_times_the_weight_with_its_gradient(fused, grad_dtype, monkeypatch):
    # forward: the INT8 GEMM (or torch's) against the fp32 simulation; backward:
    # act_int8's straight-through gradient, the step's share included, exact
    # where the bf16 product is (small integers)
    if fused and not fused_int8_available():
        pytest.skip("the fused INT8 kernel does not build here")
    torch.manual_seed(0)
    n, k = 48, 64
    w = torch.randint(-2, 3, (n, k), dtype=torch.int8)
    ones = torch.ones(n)
    if not fused:
        monkeypatch.setattr(sim, "fused_int8_available", lambda: False)
    gemm = sim.integer_gemm(w, ones)
    assert isinstance(gemm, PackedInt8Gemm) == fused
    x = torch.randn(40, k) * torch.rand(40, 1) * 4
    x[3] = 0  # a zero row: no step to share
    x[5, :2] = x[5].abs().max() + 1  # two largest elements share the step's gradient
    x.requires_grad_(True)
    g = torch.randint(-1, 2, (40, n)).float()
    y = _IntegerProduct.apply(x, gemm, w.to(grad_dtype))
    y.backward(g)
    got, x.grad = x.grad.clone(), None
    want = F.linear(act_int8(x), w.float())
    want.backward(g)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got, x.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], g[3] @ w.float())


def test_straight_through_values_are_the_fake_quantization_bit_for_bit():
    # the training forward must be the model the simulation scores: per-token
    # INT8 inputs and KV4 rows equal sim's fake quantization exactly (the bare
    # x + step * sg((xq - x) / step) misses it by a bit on a third of them),
    # and the gradient stays that expression's (LSQ: 1 + the step's share)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-6, 3, 64)[:, None, None]
    x[7] = 0
    kv = KVFakeQuant(Int4KVCacheLayout(3, 64, 16), lambda: True)
    for fq, want in ((act_int8, sim.fake_quant_act_int8(x)), (kv.fake_quant, kv.layout.fake_quant(x))):
        xs = x.clone().requires_grad_(True)
        y = fq(xs)
        assert torch.equal(y, want)
        g = torch.randn(y.shape, generator=gen)
        y.backward(g)
        xr = x.clone().requires_grad_(True)
        ref_step = ((xr.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12) if fq is act_int8 else
                    ((xr.amax(-1, keepdim=True) - xr.amin(-1, keepdim=True)) / 15).clamp_min(1e-8))
        ref = xr + ref_step * ((want - xr) / ref_step).detach()
        ref.backward(g)
        torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=0)
        assert not torch.equal(xs.grad, g)  # the step's share is there


def test_spread_windows_are_evenly_spaced_in_order():
    windows = [[i] for i in range(10)]
    assert spread_windows(windows, 3) == [[0], [3], [6]]
    assert spread_windows(windows, 4) == [[0], [2], [5], [7]]
    assert spread_windows(windows, 0) == windows and spread_windows(windows, 10) == windows
    assert spread_windows(windows, 25) == windows


def test_the_qserve_presets_tune_briefly_and_the_pipeline_takes_that_many_windows(tmp_path):
    for name in ("g64", "g128", "chn"):
        cfg = get_preset(name)
        assert (cfg.scale_tuning_epochs, cfg.scale_tuning_windows) == (1, 20), name
    # the baselines and the ablation's round-to-nearest start do not tune
    assert get_preset("rtn-w4a8kv4-g64").scale_tuning_epochs == 0
    source = tiny_source("llama", tmp_path)
    cfg = get_preset("g64", calib_samples=4, calib_seq_len=64, scale_tuning_windows=2)
    result = quantize_model(source, cfg, calib(4), progress=False)
    assert "scale-tuning" in result.steps and len(result.scale_tuning.curve) == 2
    p = argparse.ArgumentParser()
    add_quant_args(p)
    assert quant_config_from_args(p.parse_args(["--scale-tuning-windows", "5"])).scale_tuning_windows == 5
    assert quant_config_from_args(p.parse_args(["--scale-tuning-epochs", "0"])).scale_tuning_epochs == 0
    with pytest.raises(ValueError, match="scale_tuning_windows"):
        get_preset("g64", scale_tuning_windows=-1)


def test_the_tuned_preset_is_g64_with_the_long_tuning_and_has_an_alias(monkeypatch):
    from qoqserve.quant import default_checkpoint
    tuned, plain = get_preset("g64-tuned"), get_preset("g64")
    assert dataclasses.replace(tuned, name="g64", scale_tuning_epochs=1, scale_tuning_windows=20) == plain
    assert (tuned.scale_tuning_epochs, tuned.scale_tuning_windows) == (2, 0)
    p = argparse.ArgumentParser()
    add_quant_args(p)
    assert quant_config_from_args(p.parse_args(["--config", "g64-tuned"])) == tuned
    asked = []
    monkeypatch.setattr(default_checkpoint, "default_qoq_checkpoint", lambda preset: asked.append(preset) or "x")
    assert default_checkpoint.resolve_model("QoQ-Tuned") == "x" and asked == ["g64-tuned"]


def test_without_torch_bf16_kernels_the_backward_products_are_fp32(case, monkeypatch):
    # where torch's bf16 GEMM has no vector kernel (below AVX-512) the tuning
    # runs its gradients' products in fp32 and still trains
    from qoqserve.kernels.cpu import isa
    from qoqserve.quant import ste
    monkeypatch.setattr(isa, "torch_has_avx512_kernels", lambda: False)
    assert ste.grad_dtype() == torch.float32
    source, cfg, quantized = case
    model, teacher = copy.deepcopy(quantized), _fp(source, cfg)
    start = _kl(model, teacher, WINDOWS)
    tune_scales(model, teacher, WINDOWS, epochs=6, lr=3e-3, seed=0)
    # it trains: -8.3% on an Intel Xeon with AMX for the per-channel case
    # (2026-12-06), over 10% on the AMD hosts before; untrained it stays put
    assert _kl(model, teacher, WINDOWS) < start * 0.95



def test_the_tuned_linears_at_theta_zero_are_the_simulation_bit_for_bit(case):
    # per group and per channel: the INT8 GEMM with unit scales, s1 after it
    # (and per channel the zero point's row-sum term) is the reference
    # simulation's product before any step
    from qoqserve.quant.scale_tuning import _tuning
    _, _, quantized = case
    model = copy.deepcopy(quantized)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    gen = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(9, m.in_features, generator=gen) * 3 for n, m in linears}
    ref = {n: m.method.apply(m, xs[n]) for n, m in linears}
    with torch.no_grad(), _tuning(model, tune_norms=False):
        for name, m in linears:
            assert type(m.method).__name__ == "_TunedQoQ"
            assert torch.equal(m.method.apply(m, xs[name]), ref[name]), name
