"""Multimodal checkpoints served as their text model (Gemma 3 4B/12B/27B,
Mistral Small 3.1, Llava/Pixtral): the vision parts are not read, the
text_config is read as transformers fills it in, and the text model's
logits are transformers' for text alone."""
import torch
import transformers
from test_gemma3 import WINDOW, _ours
from test_model_parity import full_logits
from test_quant_pipeline import _any_tokenizer

from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout
from qoqserve.model_loader import load_model_source
from qoqserve.models.arch import ModelArchConfig
from qoqserve.models.llama import LlamaForCausalLM


def test_the_text_model_of_a_multimodal_checkpoint(tmp_path):
    # Gemma 3 4B/12B/27B ship as Gemma3ForConditionalGeneration: the text model
    # is read from it (its vision tower is not), as transformers runs text alone
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    model, arch = _ours(str(tmp_path))
    assert arch.architecture == "gemma3" and arch.attn_scale == 24 ** -0.5
    ids = torch.randint(0, 296, (3 * WINDOW,))
    with torch.inference_mode():
        torch.testing.assert_close(full_logits(model, ids), ref(input_ids=ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_a_multimodal_config_as_the_hub_writes_it():
    # google/gemma-3-4b-it's config.json: its text_config leaves transformers' defaults out
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}}
    arch = ModelArchConfig.from_hf_config(hub)
    assert (arch.vocab_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (262208, 8, 4, 256)
    assert arch.attn_scale == 256 ** -0.5 and arch.eos_token_ids == [1, 106] and arch.tie_word_embeddings
    assert [arch.window_of(i) for i in range(12)] == ([1024] * 5 + [None]) * 2
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0} and arch.rope_local_theta == 1e4


def test_the_text_model_of_a_mistral_small_3_checkpoint(tmp_path):
    # Mistral Small 3.1 ships as Mistral3ForConditionalGeneration (a Pixtral vision tower)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, head_dim=16)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=299)
    torch.manual_seed(0)
    ref = transformers.Mistral3ForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path)
    _any_tokenizer().save(str(tmp_path))
    src = load_model_source(str(tmp_path))
    assert src.arch.architecture == "llama" and src.arch.sliding_window is None
    model = LlamaForCausalLM(src.arch, AttentionBackend(DenseKVCacheLayout(2, 16, 16, torch.float32)), torch.float32)
    model.load_weights(src.iter_tensors())
    ids = torch.randint(0, 296, (40,))
    with torch.inference_mode():
        torch.testing.assert_close(full_logits(model, ids), ref(input_ids=ids[None]).logits[0], atol=1e-4, rtol=1e-4)
