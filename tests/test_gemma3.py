"""Gemma 3 (text; Gemma3ForCausalLM): embeddings times sqrt(hidden), RMSNorms
of 1 + w (stored w), sandwich norms around attention and the MLP, GeGLU
(tanh), per-head q/k norms, the scores scaled by query_pre_attn_scalar,
five sliding-window layers to a global one with their own RoPE base, the
global ones' RoPE scaling. Parity with transformers from an HF dir (torch
ops and the C ones), the engine's greedy tokens past the window."""
import pytest
import torch
import transformers
from test_model_parity import full_logits
from test_quant_pipeline import _any_tokenizer, calib, qoq_engine_matches_simulation, tiny_source

from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout
from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.models.arch import ModelArchConfig, UnsupportedModelError
from qoqserve.models.llama import LlamaForCausalLM
from qoqserve.sampling_params import SamplingParams

WINDOW = 16


def tiny_gemma3():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        max_position_embeddings=256, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=1e6,
        rope_local_base_freq=1e4, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    return randomized(transformers.Gemma3ForCausalLM, cfg)


def randomized(model_cls, cfg):
    """A transformers model of cfg in eager attention (SDPA cannot soft-cap or
    slide in every version) with every weight drawn at 0.3: norms too, whose
    stored w - 1 must become 1 + (w - 1)."""
    cfg.architectures = [model_cls.__name__]
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def saved(ref, path) -> str:
    """ref as an HF directory at path, with a real tokenizer."""
    ref.save_pretrained(path)
    _any_tokenizer().save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    ref = tiny_gemma3()
    return ref, saved(ref, tmp_path_factory.mktemp("gemma3"))


def ours(arch, tensors, ops=None) -> LlamaForCausalLM:
    """Our fp32 model of arch over dense pages, its weights loaded from tensors."""
    model = LlamaForCausalLM(arch, AttentionBackend(DenseKVCacheLayout(arch.num_kv_heads, arch.head_dim, 16,
                                                                       torch.float32)), torch.float32,
                             token_ops=ops)
    model.load_weights(tensors)
    return model


def _ours(path, ops=None):
    src = load_model_source(path)
    return ours(src.arch, src.iter_tensors(), ops), src.arch


def test_the_config_reads_as_transformers_does(gemma3):
    ref, path = gemma3
    arch = load_model_source(path).arch
    assert (arch.architecture, arch.mlp_act, arch.tie_word_embeddings) == ("gemma3", "gelu_tanh", True)
    assert arch.attn_scale == 24 ** -0.5 and arch.embed_scale == 8.0 and arch.rope_local_theta == 1e4
    assert [arch.window_of(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0} and arch.rope_theta == 1e6
    back = ModelArchConfig.from_hf_config(arch.to_hf_config("float32"))
    assert back == arch
    # soft caps (Gemma 2's; Gemma 3 has none) are read where a config sets them
    capped = ModelArchConfig.from_hf_config({**arch.to_hf_config("float32"), "attn_logit_softcapping": 50.0})
    assert (capped.attn_softcap, capped.logit_softcap) == (50.0, None)
    with pytest.raises(UnsupportedModelError, match="soft cap"):
        ModelArchConfig.from_hf_config({**arch.to_hf_config("float32"), "final_logit_softcapping": -1})


@pytest.mark.parametrize("ops", [TorchTokenOps, CpuTokenOps])
def test_logits_are_transformers_past_the_window(gemma3, ops):
    ref, path = gemma3
    model, _ = _ours(path, ops())
    ids = torch.randint(0, 300, (4 * WINDOW,))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def test_the_engine_decodes_what_transformers_predicts(gemma3):
    ref, path = gemma3
    llm = LLM(path, dtype="float32", num_blocks=32)
    assert llm.engine.runner.captured is not None
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + out])).logits[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out
    want = torch.log_softmax(logits[:len(prompt) - 1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(llm.engine.prompt_logprobs(prompt), want, atol=1e-4, rtol=0)


def test_a_gguf_as_llama_cpp_writes_it(tmp_path):
    import gguf
    from test_model_loader import _write_gguf
    ref = tiny_gemma3()
    path = tmp_path / "gemma3.gguf"
    # llama.cpp's Gemma 3 file: norms with the 1 added, the window, linear
    # scaling for the global layers; the sliding ones' base and the query
    # scale are llama.cpp's defaults (10k; head_dim), so this model's 24 is
    # not what a GGUF can say: the reference is rebuilt with head_dim's
    _write_gguf(path, ref, "gemma3", "gpt-2", meta=lambda w: (
        w.add_sliding_window(WINDOW), w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
        w.add_rope_scaling_factor(2.0)))
    src = load_model_source(str(path))
    arch = src.arch
    assert (arch.architecture, arch.mlp_act, arch.embed_scale, arch.rope_local_theta) == ("gemma3", "gelu_tanh", 8.0,
                                                                                           1e4)
    # newer converters write the pattern as a flag per layer
    flagged = tmp_path / "flags.gguf"
    _write_gguf(flagged, ref, "gemma3", "gpt-2", meta=lambda w: (
        w.add_sliding_window(WINDOW), w.add_array("gemma3.attention.sliding_window_pattern", [True, False] * 3)))
    assert load_model_source(str(flagged)).arch.sliding_layers == (0, 2, 4)
    assert [arch.window_of(i) for i in range(6)] == [WINDOW] * 5 + [None] and arch.attn_scale == 32 ** -0.5
    gguf_runs_as_reference(path, src, ref, torch.randint(0, 300, (4 * WINDOW,)), tmp_path)


def gguf_runs_as_reference(path, src, ref, ids, tmp_path) -> None:
    """Our model from the Gemma GGUF at path (src) gives transformers' ref's
    logits on ids, ref's scores scaled by head_dim as llama.cpp's rule has
    it (a GGUF cannot say query_pre_attn_scalar); exported as an HF
    directory (the norms back to Gemma's w - 1), transformers runs it as ref."""
    d = src.arch.head_dim
    model = ours(src.arch, src.iter_tensors())
    ref.config.query_pre_attn_scalar = d
    for layer in ref.model.layers:
        layer.self_attn.scaling = d ** -0.5
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(model, ids), want, atol=1e-4, rtol=1e-4)
    from qoqserve.model_loader.export import export_hf_dir
    back = transformers.AutoModelForCausalLM.from_pretrained(export_hf_dir(str(path), str(tmp_path / "hf"), "float32"),
                                                             attn_implementation="eager").eval()
    with torch.inference_mode():
        torch.testing.assert_close(back(ids[None]).logits[0], want, atol=1e-4, rtol=1e-4)


def test_the_c_token_ops_round_as_torch_in_bf16():
    g = torch.Generator().manual_seed(2)
    ref, c = TorchTokenOps(), CpuTokenOps()
    gate_up = (torch.randn(9, 2 * 200, generator=g) * 3).bfloat16()
    got, want = c.gelu_mul(gate_up).float(), ref.gelu_mul(gate_up).float()
    # the GELU's tanh (libm's against torch's) may land one bf16 step apart, then the product
    assert ((got - want).abs() <= 2 ** -6 * want.abs().clamp(min=1e-2)).all()
    assert (got == want).float().mean() > 0.98
    table, ids = torch.randn(50, 96, generator=g).bfloat16(), torch.randint(0, 50, (7,), generator=g)
    assert torch.equal(c.embed(ids, table, 96 ** 0.5), ref.embed(ids, table, 96 ** 0.5))
    assert torch.equal(c.embed(ids, table.float(), 8.0), ref.embed(ids, table.float(), 8.0))


def test_a_qoq_checkpoint_runs_on_the_engine_as_its_simulation(tmp_path, caplog):
    from qoqserve.quant.config import get_preset
    from qoqserve.quant.pipeline import quantize_model
    source = tiny_source("gemma3", tmp_path)  # outlier-y weights, as the other architectures' QoQ tests
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64, scale_tuning_epochs=0)
    assert cfg.rotate and not cfg.smooth_in
    with caplog.at_level("WARNING", logger="qoqserve.quant.pipeline"):
        result = quantize_model(source, cfg, calib(), progress=False)
    # no residual rotation (Gemma's output norms do not commute with one): the
    # block inputs smoothed into the norms instead
    assert not result.config.rotate and result.config.smooth_in and "no residual rotation" in caplog.text
    assert all("alpha_qkv" in info and "alpha_gate" in info for info in result.layer_info)
    # chunks of 32 past the window of 24, the sliding layers' KV4 pages in a pool of their own
    llm = qoq_engine_matches_simulation(result, source, calib(), tmp_path / "qoq", calib(1, 60, seed=9).samples[0],
                                        max_num_seqs=1, max_num_batched_tokens=32)
    assert llm.engine.runner.num_window_pages < llm.engine.runner.num_blocks


def test_bench_memory_counts_what_the_engine_holds(gemma3):
    from qoqserve.bench.memory import plan_memory
    from qoqserve.bench.precisions import get_precision
    _, path = gemma3
    plan = plan_memory(load_model_source(path).arch, get_precision("fp32"), "cpu", seq_len=100, budget_bytes=2**24)
    stats = LLM(path, dtype="float32", kv_cache_gb=2**24 / 2**30).engine.stats()
    # four norms a layer, q/k norms, a second RoPE table for the sliding layers
    assert stats["weight_bytes"] == plan.weight_bytes and plan.num_pages == stats["num_kv_blocks"]
