"""LongRoPE (Phi-3-mini-128k, Phi-3-medium-128k, Phi-3.5-mini): per-frequency
factors, long where the context served passes the pretrained one, else
short, and cos/sin scaled. The tables against transformers' own, logits
against transformers from an HF dir and from a GGUF (its factors as
tensors, as llama.cpp writes them), the engine's greedy tokens, refusals."""
import numpy as np
import pytest
import torch
import transformers
from test_model_loader import _write_gguf
from test_model_parity import full_logits
from test_quant_pipeline import _any_tokenizer

from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout
from qoqserve.layers.rotary import RotaryEmbedding
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.models.arch import ModelArchConfig, UnsupportedModelError
from qoqserve.models.llama import LlamaForCausalLM
from qoqserve.sampling_params import SamplingParams

ORIG, LONG_CTX, HEAD_DIM = 32, 128, 16


def _factors(seed):
    g = torch.Generator().manual_seed(seed)
    return (1 + 3 * torch.rand(HEAD_DIM // 2, generator=g)).tolist()


def tiny_phi3_longrope(partial: float = 1.0):
    """A tiny random Phi-3 with LongRoPE (partial < 1: on that share of each
    head's channels, as Phi-4-mini's 0.75)."""
    freqs = int(HEAD_DIM * partial) // 2
    cfg = transformers.Phi3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LONG_CTX, original_max_position_embeddings=ORIG,
        rope_scaling={"rope_type": "longrope", "long_factor": _factors(1)[:freqs],
                      "short_factor": _factors(2)[:freqs], "partial_rotary_factor": partial},
        partial_rotary_factor=partial, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["Phi3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _ours(ref, max_positions):
    arch = ModelArchConfig.from_hf_config(ref.config.to_dict())
    model = LlamaForCausalLM(arch, AttentionBackend(DenseKVCacheLayout(2, HEAD_DIM, 16, torch.float32)), torch.float32,
                             max_positions=max_positions)
    model.load_weights(ref.state_dict().items())
    return model, arch


def test_the_tables_are_transformers_long_past_the_pretrained_context_and_short_within():
    ref = tiny_phi3_longrope()
    arch = ModelArchConfig.from_hf_config(ref.config.to_dict())
    scaling = arch.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIG
    assert scaling["factor"] == LONG_CTX / ORIG and scaling["attention_factor"] > 1
    x = torch.zeros(1, 1, HEAD_DIM)
    for context, length in ((LONG_CTX, 100), (ORIG, 30)):  # transformers picks by the forward's length
        ours = RotaryEmbedding(HEAD_DIM, context, arch.rope_theta, scaling)
        cos, sin = ref.model.rotary_emb(x, torch.arange(length)[None])
        torch.testing.assert_close(ours.cos[:length], cos[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.sin[:length], sin[0], rtol=1e-6, atol=1e-6)
    # the two sets differ: a table of the other one fails
    short = RotaryEmbedding(HEAD_DIM, ORIG, arch.rope_theta, scaling)
    assert not torch.allclose(short.cos[:30], RotaryEmbedding(HEAD_DIM, LONG_CTX, arch.rope_theta, scaling).cos[:30])


def matches_transformers_with_either_set(ref) -> None:
    """Our logits are ref's with the long factors (a context past the pretrained
    one, a sequence past it) and with the short ones (both within it)."""
    for context, length in ((LONG_CTX, 100), (ORIG, 30)):
        model, _ = _ours(ref, context)
        ids = torch.randint(0, 300, (length,))
        with torch.inference_mode():
            want = ref(ids[None]).logits[0]
        torch.testing.assert_close(full_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def test_logits_are_transformers_with_either_set():
    matches_transformers_with_either_set(tiny_phi3_longrope())


def test_a_gguf_with_llama_cpps_factor_tensors(tmp_path):
    ref = tiny_phi3_longrope()
    scaling = ModelArchConfig.from_hf_config(ref.config.to_dict()).rope_scaling
    path = tmp_path / "phi3-128k.gguf"
    # as llama.cpp's converter writes it: the factors as tensors, the pretrained
    # context and the attention factor as metadata, no rope.scaling.type
    _write_gguf(path, ref, "phi3", "gpt-2", extra={
        "rope_factors_long.weight": np.array(scaling["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(scaling["short_factor"], dtype=np.float32)},
        meta=lambda w: (w.add_rope_scaling_orig_ctx_len(ORIG), w.add_rope_scaling_attn_factors(
            scaling["attention_factor"])))
    src = load_model_source(str(path))
    got = src.arch.rope_scaling
    assert ({k: v for k, v in got.items() if "factor" not in k}
            == {k: v for k, v in scaling.items() if "factor" not in k})
    for key in ("long_factor", "short_factor", "factor", "attention_factor"):  # through float32 tensors and metadata
        assert got[key] == pytest.approx(scaling[key], rel=1e-6), key
    assert src.arch.max_position_embeddings == LONG_CTX
    ours = LlamaForCausalLM(src.arch, AttentionBackend(DenseKVCacheLayout(2, HEAD_DIM, 16, torch.float32)),
                            torch.float32)
    ours.load_weights(src.iter_tensors())
    ids = torch.randint(0, 300, (100,))
    with torch.inference_mode():
        torch.testing.assert_close(full_logits(ours, ids), ref(ids[None]).logits[0], atol=1e-4, rtol=1e-4)
    one = tmp_path / "one.gguf"
    _write_gguf(one, ref, "phi3", "gpt-2", extra={"rope_factors_long.weight": np.ones(8, dtype=np.float32)},
                meta=lambda w: w.add_rope_scaling_orig_ctx_len(ORIG))
    with pytest.raises(Exception, match="rope_factors_long and rope_factors_short"):
        load_model_source(str(one))


def test_the_engine_decodes_what_transformers_predicts_with_either_set(tmp_path):
    ref = tiny_phi3_longrope()
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    # the model's whole context by default: the long factors, for a prompt past the pretrained one
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=32)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        assert ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == out
    # a context within the pretrained one: the short factors, as transformers within it
    short = LLM(str(tmp_path), dtype="float32", num_blocks=32, max_model_len=ORIG)
    out = short.generate([prompt[:12]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        assert ref(torch.tensor([prompt[:12] + out])).logits[0, 11:-1].argmax(-1).tolist() == out


def test_incomplete_longrope_configs_are_refused():
    base = dict(architectures=["Phi3ForCausalLM"], vocab_size=8, hidden_size=64, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=LONG_CTX,
                original_max_position_embeddings=ORIG)
    with pytest.raises(UnsupportedModelError, match="long and a short factor for each of 8"):
        ModelArchConfig.from_hf_config({**base, "rope_scaling": {
            "type": "su", "long_factor": [1.0] * 7, "short_factor": [1.0] * 8}})
    with pytest.raises(UnsupportedModelError, match="needs long_factor"):
        ModelArchConfig.from_hf_config({**base, "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 8}})
    su = ModelArchConfig.from_hf_config({**base, "rope_scaling": {  # its first name
        "type": "su", "long_factor": [2.0] * 8, "short_factor": [1.0] * 8}})
    assert su.rope_scaling["rope_type"] == "longrope"


