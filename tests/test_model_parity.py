"""Our model's logits vs transformers' on the same weights."""
import pytest
import torch
import transformers

from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout
from qoqserve.models.arch import ModelArchConfig, UnsupportedModelError
from qoqserve.models.llama import LlamaForCausalLM

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def tiny_llama3():
    cfg = transformers.LlamaConfig(
        **SMALL, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cfg.architectures = ["LlamaForCausalLM"]
    return transformers.LlamaForCausalLM(cfg)


def tiny_qwen2():
    cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises biases to zero, which would not test them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def tiny_qwen3():
    # head_dim 32, not hidden / heads = 16: q_size 128 against a hidden size of 64
    cfg = transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3ForCausalLM"]
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises the q/k norms to ones, which would not test them
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 2.0)
    return model


def tiny_phi3():
    # q/k/v as one qkv_proj and gate/up as one gate_up_proj in the checkpoint
    cfg = transformers.Phi3Config(**SMALL, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["Phi3ForCausalLM"]
    return transformers.Phi3ForCausalLM(cfg)


def tiny_smollm3():
    # every 4th layer without RoPE: layer 3 of 4
    cfg = transformers.SmolLM3Config(**{**SMALL, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, tie_word_embeddings=True)
    cfg.architectures = ["SmolLM3ForCausalLM"]
    return transformers.SmolLM3ForCausalLM(cfg)


def ours_from(ref, dtype=torch.float32):
    arch = ModelArchConfig.from_hf_config(ref.config.to_dict())
    attention = AttentionBackend(DenseKVCacheLayout(arch.num_kv_heads, arch.head_dim, 16, dtype))
    model = LlamaForCausalLM(arch, attention, dtype)
    model.load_weights(ref.state_dict().items())
    return model, arch


def full_logits(model, ids):
    meta = AttentionMetadata(True, None, None, None, [0, len(ids)], [0])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta, None))


@pytest.mark.parametrize("make", [tiny_llama3, tiny_qwen2, tiny_qwen3, tiny_phi3, tiny_smollm3])
def test_tiny_configs_match_transformers(make):
    torch.manual_seed(0)
    ref = make().eval()
    model, arch = ours_from(ref)
    if make is tiny_qwen2:
        assert arch.attention_bias and arch.tie_word_embeddings
    elif make is tiny_qwen3:
        assert arch.qk_norm and arch.head_dim == 32 and not arch.attention_bias
    elif make is tiny_phi3:
        assert arch.fused_checkpoint_linears and "model.layers.0.self_attn.qkv_proj.weight" in ref.state_dict()
    elif make is tiny_smollm3:
        assert arch.nope_layers == (3,) and model.layers[3].self_attn.rope is None
        assert ModelArchConfig.from_hf_config(arch.to_hf_config("float32")).nope_layers == (3,)
    else:
        assert arch.rope_scaling["rope_type"] == "llama3"
    # long enough that llama3 scaling (original context 64) matters
    ids = torch.randint(0, SMALL["vocab_size"], (300,))
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0].float()
    got = full_logits(model, ids)
    assert expected.std() > 0.05  # a real signal, not near-zero logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_parity_test_detects_a_wrong_weight():
    torch.manual_seed(0)
    ref = tiny_llama3().eval()
    model, _ = ours_from(ref)
    with torch.no_grad():
        model.layers[1].self_attn.qkv_proj.weight[70, 3] += 0.5  # a k_proj entry
    ids = torch.randint(0, SMALL["vocab_size"], (64,))
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0].float()
    assert (full_logits(model, ids) - expected).abs().max() > 1e-3


def test_missing_tensor_is_named():
    torch.manual_seed(0)
    ref = tiny_llama3()
    arch = ModelArchConfig.from_hf_config(ref.config.to_dict())
    model = LlamaForCausalLM(arch, AttentionBackend(DenseKVCacheLayout(2, 16, 16, torch.float32)), torch.float32)
    state = {k: v for k, v in ref.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        model.load_weights(state.items())


def test_wrong_shape_is_named():
    torch.manual_seed(0)
    ref = tiny_llama3()
    arch = ModelArchConfig.from_hf_config(ref.config.to_dict())
    model = LlamaForCausalLM(arch, AttentionBackend(DenseKVCacheLayout(2, 16, 16, torch.float32)), torch.float32)
    state = dict(ref.state_dict())
    state["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(5, 64)
    with pytest.raises(ValueError, match="v_proj"):
        model.load_weights(state.items())


def test_an_activation_other_than_silu_is_refused():
    cfg = tiny_llama3().config.to_dict()
    assert ModelArchConfig.from_hf_config({**cfg, "hidden_act": "swish"}).architecture == "llama"
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        ModelArchConfig.from_hf_config({**cfg, "hidden_act": "gelu"})


def test_a_partial_rotary_factor_that_leaves_an_odd_channel_count_is_refused():
    # Phi-4-mini's 0.75 of 128 turns 96 channels (tests/test_partial_rotary.py); 0.3 of 16 would turn 4.8
    cfg = tiny_phi3().config.to_dict()
    assert ModelArchConfig.from_hf_config({**cfg, "partial_rotary_factor": 0.75}).rotary_dim == 12
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.1"):
        ModelArchConfig.from_hf_config({**cfg, "partial_rotary_factor": 0.1})


@pytest.mark.parametrize("make", [tiny_phi3, tiny_smollm3])
def test_the_engine_on_the_c_kernels_decodes_what_transformers_predicts(make, tmp_path):
    """The served path (C token ops, captured decode steps, paged attention) on
    the architectures whose loading or RoPE differs from Llama's."""
    from test_quant_pipeline import _any_tokenizer

    from qoqserve.llm import LLM
    from qoqserve.sampling_params import SamplingParams

    torch.manual_seed(0)
    ref = make().eval()
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=32, enable_prefix_caching=False)
    prompt = torch.randint(3, SMALL["vocab_size"], (24,)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + out])).logits[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


@pytest.mark.parametrize("tied", [True, False])
def test_granites_multipliers_folded_at_load_give_transformers_logits(tied, tmp_path):
    from test_quant_pipeline import _any_tokenizer

    from qoqserve.model_loader import load_model_source

    torch.manual_seed(0)
    cfg = transformers.GraniteConfig(**SMALL, pad_token_id=0, tie_word_embeddings=tied, embedding_multiplier=12.0,
                                     residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=8.0)
    cfg.architectures = ["GraniteForCausalLM"]
    ref = transformers.GraniteForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    src = load_model_source(str(tmp_path))
    assert src.arch.architecture == "llama"  # what is left once the multipliers are in the weights
    model = LlamaForCausalLM(src.arch, AttentionBackend(DenseKVCacheLayout(2, 16, 16, torch.float32)), torch.float32)
    model.load_weights(src.iter_tensors())
    ids = torch.randint(0, SMALL["vocab_size"], (200,))
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0].float()
    assert expected.std() > 0.01  # logits_scaling 8 makes them small: the tolerance is 8x tighter
    torch.testing.assert_close(full_logits(model, ids), expected, atol=1.25e-5, rtol=1e-4)
    # a tensor-parallel rank's lazy reads fold alike, narrowed or whole
    eager = dict(src.iter_tensors())
    for name, lazy in src.lazy_iter_factory():
        assert torch.equal(lazy.materialize(), eager[name]), name
        assert torch.equal(lazy.narrow(0, 1, 2).materialize(), eager[name][1:3]), name


YARN_CASES = [dict(factor=4.0, original_max_position_embeddings=64),
              dict(factor=8.0, original_max_position_embeddings=128, beta_fast=16, beta_slow=2, truncate=False),
              dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
              dict(factor=2.0, original_max_position_embeddings=64, attention_factor=1.25)]


@pytest.mark.parametrize("params", YARN_CASES)
def test_yarn_tables_are_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qoqserve.layers.rotary import RotaryEmbedding

    cfg = transformers.Qwen2Config(**SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **params})
    cfg.architectures = ["Qwen2ForCausalLM"]
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    arch = ModelArchConfig.from_hf_config(cfg.to_dict())
    assert arch.max_position_embeddings == max(SMALL["max_position_embeddings"],
                                               int(params["factor"] * params["original_max_position_embeddings"]))
    rope = RotaryEmbedding(arch.head_dim, 512, arch.rope_theta, arch.rope_scaling)
    pos = torch.arange(512, dtype=torch.float32)[:, None]
    want = torch.cat([pos * inv_freq, pos * inv_freq], -1)
    torch.testing.assert_close(rope.cos, want.cos() * attention, atol=2e-5, rtol=0)
    torch.testing.assert_close(rope.sin, want.sin() * attention, atol=2e-5, rtol=0)
    assert ModelArchConfig.from_hf_config(arch.to_hf_config("float32")).rope_scaling == arch.rope_scaling


def test_a_yarn_model_past_its_pretrained_context_gives_transformers_logits():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, **YARN_CASES[0]})
    cfg.architectures = ["Qwen2ForCausalLM"]
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    model, arch = ours_from(ref)
    ids = torch.randint(0, SMALL["vocab_size"], (300,))  # past 64 pretrained positions, within 4 x 64
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0].float()
    torch.testing.assert_close(full_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make", [tiny_llama3, tiny_qwen3, tiny_phi3, tiny_smollm3])
def test_bench_offline_builds_transformers_own_model_of_the_source(make, tmp_path):
    """`bench offline`'s baseline: transformers' model of the architecture (for
    SmolLM3 with its layers without RoPE), with the engine's weights."""
    from test_quant_pipeline import _any_tokenizer

    from qoqserve.bench.offline import load_transformers
    from qoqserve.model_loader import load_model_source

    torch.manual_seed(0)
    ref = make().eval()
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    hf = load_transformers(load_model_source(str(tmp_path)), torch.float32)
    assert type(hf) is type(ref)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 100))
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
