"""Models trained with sliding-window attention (Mistral 7B v0.1, Phi-3-mini-4k,
Qwen2 with use_sliding_window): each sliding layer's queries see their last
`window` positions, on every path, so these models are served to their whole
context. Which configs slide and where, parity with transformers past the
window (per layer, too), the engine on the C kernels (chunked prefill,
captured decode steps) against transformers, and a QoQ checkpoint on the
engine against its own simulation."""
import pytest
import torch
import transformers
from test_model_parity import SMALL, full_logits, ours_from
from test_quant_pipeline import calib, qoq_engine_matches_simulation, tiny_source

from qoqserve.config import EngineConfig, SchedulerConfig
from qoqserve.engine.context_window import context_len, warn_about_context
from qoqserve.llm import LLM
from qoqserve.models.arch import ModelArchConfig, UnsupportedModelError
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import quantize_model
from qoqserve.sampling_params import SamplingParams

WINDOW = 48


def _eager(cfg, cls):
    cfg._attn_implementation = "eager"  # the windowed mask in every transformers version
    torch.manual_seed(0)
    return cls(cfg).eval()


def tiny_mistral(window=WINDOW):
    cfg = transformers.MistralConfig(**SMALL, sliding_window=window, tie_word_embeddings=False)
    cfg.architectures = ["MistralForCausalLM"]
    return _eager(cfg, transformers.MistralForCausalLM)


def tiny_qwen2_half_sliding(window=WINDOW):
    """Qwen2 with use_sliding_window: layers from max_window_layers (1 of 2) slide."""
    cfg = transformers.Qwen2Config(**SMALL, sliding_window=window, use_sliding_window=True, max_window_layers=1)
    cfg.architectures = ["Qwen2ForCausalLM"]
    return _eager(cfg, transformers.Qwen2ForCausalLM)


@pytest.mark.parametrize("make", [tiny_mistral, tiny_qwen2_half_sliding])
def test_past_the_window_the_logits_are_transformers(make):
    ref = make()
    model, arch = ours_from(ref)
    assert arch.sliding_window == WINDOW
    ids = torch.randint(0, SMALL["vocab_size"], (3 * WINDOW,))
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0].float()
    torch.testing.assert_close(full_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
    # the test can tell: the same weights attending to everything differ past the window
    for layer in model.layers:
        layer.self_attn.attn.window = 0
    assert (full_logits(model, ids)[WINDOW + 8:] - expected[WINDOW + 8:]).abs().max() > 1e-2


def test_only_the_sliding_layers_slide():
    model, arch = ours_from(tiny_qwen2_half_sliding())
    assert arch.sliding_layers == (1,)
    assert [layer.self_attn.attn.window for layer in model.layers] == [0, WINDOW]


def _arch(**cfg):
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                num_attention_heads=1, max_position_embeddings=32768)
    return ModelArchConfig.from_hf_config({**base, **cfg})


def test_which_configs_slide_and_where():
    mistral = dict(architectures=["MistralForCausalLM"])
    qwen2 = dict(architectures=["Qwen2ForCausalLM"])
    cases = [
        (_arch(**mistral, sliding_window=4096), 4096, None),                 # Mistral 7B v0.1: every layer
        (_arch(**mistral, sliding_window=None), None, None),                 # v0.2 and later
        (_arch(**qwen2, sliding_window=32768, use_sliding_window=False), None, None),
        (_arch(**qwen2, sliding_window=4096, use_sliding_window=True, max_window_layers=2), 4096, (2, 3)),
        (_arch(**qwen2, sliding_window=4096, use_sliding_window=True, max_window_layers=0), 4096, None),
        (_arch(**qwen2, sliding_window=4096, use_sliding_window=True), None, None),  # default 28 >= 4 layers
        (_arch(**mistral, sliding_window=4096, layer_types=["full_attention"] * 4), None, None),
        (_arch(**mistral, sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2), 64, (0, 2)),
    ]
    for arch, window, layers in cases:
        assert (arch.sliding_window, arch.sliding_layers) == (window, layers)
        assert [arch.window_of(i) for i in range(4)] == [
            window if window and (layers is None or i in layers) else None for i in range(4)]
        # our own checkpoints' config.json keeps it (to_hf_config -> from_hf_config)
        back = ModelArchConfig.from_hf_config(arch.to_hf_config("float32"))
        assert (back.sliding_window, back.sliding_layers) == (window, layers)
    with pytest.raises(UnsupportedModelError, match="layer_types has 2 entries for 4 layers"):
        _arch(**mistral, sliding_window=64, layer_types=["sliding_attention"] * 2)


def test_a_windowed_llama_is_written_as_the_mistral_transformers_runs_with_its_window():
    hf = _arch(architectures=["MistralForCausalLM"], sliding_window=4096).to_hf_config("float32")
    assert (hf["architectures"], hf["model_type"]) == (["MistralForCausalLM"], "mistral")
    assert _arch(architectures=["LlamaForCausalLM"]).to_hf_config("float32")["architectures"] == ["LlamaForCausalLM"]


def test_the_context_is_the_models_whole_and_past_it_is_logged(caplog):
    windowed = _arch(architectures=["MistralForCausalLM"], sliding_window=4096)

    def config(n):
        return EngineConfig(model="x", scheduler=SchedulerConfig(max_model_len=n))
    assert context_len(config(None), windowed) == 32768
    assert context_len(config(8192), windowed) == 8192
    for asked, context, said in [(None, 32768, None), (65536, 65536, "past the 32768 positions")]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="qoqserve.engine.context_window"):
            warn_about_context(context, config(asked), windowed)
        assert (said in caplog.text) if said else not caplog.records, (asked, caplog.text)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(the HF dir's ModelSource, transformers' model of it): window 24, 2 layers."""
    source = tiny_source("mistral", tmp_path_factory.mktemp("mistral"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert source.arch.sliding_window == ref.config.sliding_window == 24
    return source, ref


def _greedy(llm, prompts, n):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_the_engine_decodes_past_the_window_what_transformers_predicts(mistral):
    source, ref = mistral
    # prompts shorter and longer than the window, prefilled in chunks of 16
    # (chunked prefill over pages with the window), decoded by captured steps
    llm = LLM(source.path, dtype="float32", num_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 512 and llm.engine.runner.captured is not None
    prompts = [calib(1, n, seed=n).samples[0] for n in (10, 70)]
    outs = _greedy(llm, prompts, 40)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            logits = ref(torch.tensor([prompt + out])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out
        want = torch.log_softmax(logits[:len(prompt) - 1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(llm.engine.prompt_logprobs(prompt), want, atol=1e-4, rtol=0)
    # alone or beside each other, whole or chunked: the same tokens
    whole = LLM(source.path, dtype="float32", num_blocks=64, enable_prefix_caching=False)
    assert [_greedy(whole, [p], 40)[0] for p in prompts] == outs


def test_a_qoq_checkpoint_slides_on_the_engine_as_its_simulation(mistral, tmp_path):
    source, _ = mistral
    # calibration windows of 64 tokens: past the window, so the quantizer's own passes slide too
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64, scale_tuning_epochs=0)
    result = quantize_model(source, cfg, calib(), progress=False)
    # an 80-token prompt and 24 tokens more over KV4 pages: past the window
    llm = qoq_engine_matches_simulation(result, source, calib(), tmp_path, calib(1, 80, seed=9).samples[0], 24)
    assert llm.engine.max_model_len == 512


def test_pages_before_the_window_go_back_to_the_pool_while_sequences_run(mistral):
    source, ref = mistral
    prompts = [calib(1, 10, seed=20 + i).samples[0] for i in range(4)]
    # 4 sequences of 10 + 300 tokens: 80 pages of 16 if each kept all of its
    # pages, 40 in the pool; each holds at most 8 at a time with the window
    # (24 positions, a 64-key tile before it, the pages a decode burst reserves)
    small = LLM(source.path, dtype="float32", num_blocks=40, enable_prefix_caching=False)
    outs = _greedy(small, prompts, 300)
    assert small.engine.scheduler.num_preemptions == 0
    assert small.engine.block_manager.num_free_blocks == 40  # all back, once each
    ample = LLM(source.path, dtype="float32", num_blocks=128, enable_prefix_caching=False)
    assert [_greedy(ample, [p], 300)[0] for p in prompts] == outs
    with torch.inference_mode():
        logits = ref(torch.tensor([prompts[0] + outs[0]])).logits[0]
    assert logits[len(prompts[0]) - 1:-1].argmax(-1).tolist() == outs[0]
