"""Recipes beyond the presets' defaults, on a tiny random model:
true-sequential quantization inside a layer (each linear's GPTQ Hessian from
the inputs the already-quantized linears before it produce) and the mixed
recipe (some linears kept at W8A8), through the checkpoint and the engine."""
import json

import pytest
import torch
from safetensors.torch import load_file

from qoqserve.config import CacheConfig, EngineConfig
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.layers.quantization.qoq_methods import QoQLinearMethod
from qoqserve.layers.quantization.w8a8 import W8A8LinearMethod
from qoqserve.model_loader import ModelLoadError, load_model_source
from qoqserve.quant import layer_passes, pipeline
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import get_preset
from qoqserve.quant.layer_stats import LayerCapture
from qoqserve.quant.sim import SimW8A8Method
from tests.test_quant_pipeline import _full, calib, tiny_source


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_source("llama", tmp_path_factory.mktemp("seq"))


def _quantize_recording(monkeypatch, source, true_sequential: bool):
    """Quantize (W4A16 g64: no fp16 rounding of the other tensors afterwards, so
    the final model reproduces the calibration pass exactly), recording the
    Hessian each GPTQ call got, in call order."""
    seen = []
    real = pipeline.gptq_quantize

    def spy(w, hessian, quantizer):
        seen.append(hessian.clone())
        return real(w, hessian, quantizer)

    monkeypatch.setattr(pipeline, "gptq_quantize", spy)
    cfg = get_preset("g64", a_bits=16, scale_tuning_epochs=0, calib_samples=8, calib_seq_len=64,
                     true_sequential=true_sequential)
    data = calib()
    result = pipeline.quantize_model(source, cfg, data, progress=False)
    return result, seen, data


def _hessian(model, data, layer: int, name: str) -> torch.Tensor:
    """The Hessian of layer `layer`'s `name` inputs as the finished (all-quantized) model makes them."""
    lengths = tuple(map(len, data.samples))
    hidden = torch.nn.functional.embedding(torch.tensor(data.samples).reshape(-1), model.embed_tokens)
    with torch.no_grad():
        for earlier in model.layers[:layer]:
            hidden = layer_passes.run_layer(earlier, hidden, lengths)
        cap = LayerCapture(model.layers[layer], [name], model.cfg, hessians=True)
        with cap:
            layer_passes.run_layer(model.layers[layer], hidden, lengths, stop_at=name)
    return cap.hessians[name].hessian()


def test_each_linear_sees_the_quantized_linears_before_it(monkeypatch, source):
    result, seen, data = _quantize_recording(monkeypatch, source, True)
    assert "true_sequential" in result.steps
    assert len(seen) == 2 * len(pipeline.LINEARS)  # one GPTQ call per linear per layer
    _, seen_plain, _ = _quantize_recording(monkeypatch, source, False)
    for i, name in enumerate(pipeline.LINEARS[1:], start=1):
        want = _hessian(result.model, data, 0, name)
        scale = want.abs().max()
        assert (seen[i] - want).abs().max() <= 1e-5 * scale, name
        # without it the Hessian is the FP layer's: measurably different
        assert (seen_plain[i] - want).abs().max() > 1e-3 * scale, name
    # the first linear's inputs have no quantized linear before them in the layer
    torch.testing.assert_close(seen[0], seen_plain[0])
    # the staged layer's output is the quantized layer's: layer 1 sees it
    want = _hessian(result.model, data, 1, pipeline.LINEARS[0])
    assert (seen[len(pipeline.LINEARS)] - want).abs().max() <= 1e-5 * want.abs().max()


KEPT = ("layers.0.mlp.down_proj", "layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj")


def _runner(path, backend: str) -> ModelRunner:
    loaded = load_model_source(str(path))
    cfg = EngineConfig(model=str(path), dtype="float32", w4a8_backend=backend, kernels="torch",
                       cache=CacheConfig(num_blocks=8, quantized_prefill=True))
    return ModelRunner(cfg, loaded.arch, loaded.iter_tensors(), 512, loaded.quant_config)


def test_mixed_recipe_round_trips_through_the_checkpoint(source, tmp_path):
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64,
                     w8a8_linears=("layers.0.mlp.down_proj", "*.self_attn.o_proj"))
    result = pipeline.quantize_model(source, cfg, calib(), progress=False)
    methods = {f"layers.{i}.{n}": type(layer.get_submodule(n).method)
               for i, layer in enumerate(result.model.layers) for n in pipeline.LINEARS}
    assert {k for k, m in methods.items() if m is SimW8A8Method} == set(KEPT)
    save_checkpoint(result, source, calib(), str(tmp_path))
    quant = json.loads((tmp_path / "quant_config.json").read_text())
    assert quant["w8a8_linears"] == sorted(KEPT)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    assert "model.layers.0.mlp.down_proj.qweight" not in tensors
    assert "model.layers.1.mlp.down_proj.qweight" in tensors

    ids = calib(1, 96, seed=5).samples[0]
    q = _full(result.model, ids)
    for backend in ("sim", "torch-int8"):
        runner = _runner(tmp_path, backend)
        for key, method in methods.items():
            i, name = key.split(".", 2)[1:]
            got = runner.model.layers[int(i)].get_submodule(name).method
            assert isinstance(got, W8A8LinearMethod if method is SimW8A8Method else QoQLinearMethod), key
        # the simulation is the checkpoint (its float tensors already rounded to fp16
        # storage); the INT8 GEMMs differ from its fp32 sums by rounding only
        torch.testing.assert_close(_full(runner.model, ids), q, atol=1e-4 * q.abs().max().item(), rtol=1e-4)

    # a name that is no linear is refused at load, not silently run as W4A8
    quant["w8a8_linears"] = ["layers.0.mlp.up_proj"]
    (tmp_path / "quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(ModelLoadError, match="w8a8_linears.*up_proj"):
        load_model_source(str(tmp_path))
    # listing a linear the file holds as W4A8: its fp16 weight is missing
    quant["w8a8_linears"] = sorted(KEPT) + ["layers.1.mlp.down_proj"]
    (tmp_path / "quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(ModelLoadError, match="layers.1.mlp.down_proj"):
        load_model_source(str(tmp_path))


def test_asymmetric_calibration_targets_the_fp_stream(monkeypatch, source):
    """Each GPTQ call gets the weight that maps the quantized model's inputs to
    the FP model's outputs: unchanged where the two streams still agree (layer
    0's qkv_proj sees the FP embedding either way), moved wherever an earlier
    quantized step (KV4 in layer 0's attention, all of layer 0 for layer 1)
    made them drift. The FP inputs follow the layer's permutations and scales:
    in the wrong basis the two streams would differ by more than their norm."""
    real_gptq, real_stats = pipeline.gptq_quantize, layer_passes.transformed_statistics
    drift = []

    def stats_spy(layer, hidden, seq_len, arch, cap):
        real_stats(layer, hidden, seq_len, arch, cap)
        for name in pipeline.LINEARS:  # ||x - y||^2 / ||y||^2 from H = x^T x, G = y^T x (same 2/n scale)
            y = cap.targets[name].double()
            yy = (y * y).sum() * 2 / y.shape[0]
            h, g = cap.hessians[name].hessian().double(), cap.cross[name].hessian().double()
            drift.append(float((torch.trace(h) - 2 * torch.trace(g) + yy).clamp(min=0).sqrt() / yy.sqrt()))

    def record(asymmetric):
        seen = []

        def spy(w, hessian, quantizer):
            seen.append(w.clone())
            return real_gptq(w, hessian, quantizer)

        monkeypatch.setattr(pipeline, "gptq_quantize", spy)
        cfg = get_preset("g64", calib_samples=8, calib_seq_len=64, asymmetric_calibration=asymmetric)
        return pipeline.quantize_model(source, cfg, calib(), progress=False), seen

    monkeypatch.setattr(layer_passes, "transformed_statistics", stats_spy)
    result, seen = record(True)
    assert "asymmetric_calibration" in result.steps
    plain, seen_plain = record(False)
    assert len(seen) == len(seen_plain) == len(drift) == 2 * len(pipeline.LINEARS)
    assert drift[0] < 1e-3 and max(drift[1:]) < 0.5 and min(drift[1:]) > 0.05, drift
    torch.testing.assert_close(seen[0], seen_plain[0])
    for i in range(1, len(seen)):
        assert (seen[i] - seen_plain[i]).norm() > 1e-3 * seen_plain[i].norm(), i
    with pytest.raises(ValueError, match="cannot be combined"):
        get_preset("g64", asymmetric_calibration=True, true_sequential=True)
