"""Models trained with sliding-window attention (Mistral 7B v0.1; Qwen2 with
use_sliding_window): qoqserve's attention is not windowed, so it is the
model's only while the context fits the window, and the context is bounded by
it (engine/context_window.py)."""
import pytest
import torch
import transformers
from test_model_parity import SMALL, full_logits, ours_from
from test_quant_pipeline import _any_tokenizer

from qoqserve.config import EngineConfig, SchedulerConfig
from qoqserve.engine.context_window import context_len, warn_about_context
from qoqserve.llm import LLM
from qoqserve.models.arch import ModelArchConfig
from qoqserve.sampling_params import SamplingParams

WINDOW = 48


def tiny_mistral(window=WINDOW):
    cfg = transformers.MistralConfig(**SMALL, sliding_window=window, tie_word_embeddings=False)
    cfg.architectures = ["MistralForCausalLM"]
    cfg._attn_implementation = "eager"  # the windowed mask in every transformers version
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).eval()


def test_inside_the_window_the_logits_are_transformers_and_past_it_they_would_not_be():
    ref = tiny_mistral()
    model, arch = ours_from(ref)
    assert arch.sliding_window == WINDOW and arch.architecture == "llama"
    ids = torch.randint(0, SMALL["vocab_size"], (WINDOW + 40,))
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0].float()
    got = full_logits(model, ids)
    torch.testing.assert_close(got[:WINDOW], expected[:WINDOW], atol=1e-4, rtol=1e-4)
    # why the bound: past the window the model's rows see fewer tokens than ours
    assert (got[WINDOW + 8:] - expected[WINDOW + 8:]).abs().max() > 1e-2


def _arch(**cfg):
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, max_position_embeddings=32768)
    return ModelArchConfig.from_hf_config({**base, **cfg})


def test_which_configs_slide():
    mistral = dict(architectures=["MistralForCausalLM"])
    qwen2 = dict(architectures=["Qwen2ForCausalLM"])
    assert _arch(**mistral, sliding_window=4096).sliding_window == 4096       # Mistral 7B v0.1
    assert _arch(**mistral, sliding_window=None).sliding_window is None       # v0.2 and later
    assert _arch(**qwen2, sliding_window=32768, use_sliding_window=False).sliding_window is None
    assert _arch(**qwen2, sliding_window=4096, use_sliding_window=True).sliding_window == 4096
    assert _arch(**mistral, sliding_window=4096,
                 layer_types=["full_attention"]).sliding_window is None
    # our own checkpoints' config.json keeps it (to_hf_config -> from_hf_config)
    for a in (_arch(**mistral, sliding_window=4096), _arch(**qwen2, sliding_window=4096, use_sliding_window=True),
              _arch(**qwen2, sliding_window=4096)):
        assert ModelArchConfig.from_hf_config(a.to_hf_config("float32")).sliding_window == a.sliding_window


def test_the_window_bounds_the_context():
    arch = _arch(architectures=["MistralForCausalLM"], sliding_window=4096)

    def config(n):
        return EngineConfig(model="x", scheduler=SchedulerConfig(max_model_len=n))
    assert context_len(config(None), arch) == 4096
    assert context_len(config(2048), arch) == 2048
    with pytest.raises(ValueError, match="sliding attention window \\(4096 tokens\\)"):
        context_len(config(8192), arch)
    assert context_len(config(None), _arch(architectures=["MistralForCausalLM"])) == 32768


def test_a_context_past_the_trained_positions_or_cut_by_the_window_is_logged(caplog):
    windowed = _arch(architectures=["MistralForCausalLM"], sliding_window=4096)
    plain = _arch(architectures=["LlamaForCausalLM"])
    cases = [(plain, None, 32768, None), (plain, 65536, 65536, "past the 32768 positions"),
             (windowed, None, 4096, "sliding attention window"), (windowed, 2048, 2048, None)]
    for arch, asked, context, said in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="qoqserve.engine.context_window"):
            warn_about_context(context, EngineConfig(model="x", scheduler=SchedulerConfig(max_model_len=asked)), arch)
        assert (said in caplog.text) if said else not caplog.records, (asked, caplog.text)


def test_an_engine_on_a_windowed_model_refuses_prompts_past_the_window(tmp_path):
    ref = tiny_mistral()
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    with pytest.raises(ValueError, match="sliding attention window"):
        LLM(str(tmp_path), dtype="float32", max_model_len=WINDOW + 16, num_blocks=16)
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=16, enable_prefix_caching=False)
    assert llm.engine.max_model_len == WINDOW
    prompt = torch.randint(0, SMALL["vocab_size"], (WINDOW - 8,)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(prompt) + len(out.token_ids) <= WINDOW  # stopped by the window, at its end
    with torch.inference_mode():  # and every greedy token is the windowed model's own
        seq = torch.tensor(prompt + out.token_ids)
        ref_next = ref(seq[None]).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    assert ref_next == out.token_ids
    with pytest.raises(ValueError, match=f"context length is {WINDOW}|context window is {WINDOW}"):
        llm.generate([list(range(1, WINDOW + 4))], SamplingParams(max_tokens=1))
