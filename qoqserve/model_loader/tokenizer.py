"""Text <-> token ids, chat templates and streaming detokenization.

Backed by the Rust `tokenizers` library. An HF directory brings a ready
tokenizer.json; a GGUF file only carries vocabulary, merges (or SentencePiece
scores) and token types, so `tokenizer_from_gguf_metadata` rebuilds the
equivalent tokenizer (tests/test_gguf_tokenizers.py holds the
SentencePiece one to llama.cpp's answers).
"""
from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from qoqserve.errors import ModelLoadError
from qoqserve.model_loader.chat_template import render_chat

try:  # tokenizers 0.21+
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:
    _DecodeStream = None

# llama.cpp token_type values (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's "tekken" (Mistral Nemo, Mistral Small 3): its tokenizer.json regex
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _pre_tokenizer_for(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) for a `tokenizer.ggml.pre` value.

    Mirrors llama.cpp's llama-vocab.cpp, which is what decides how a GGUF is
    tokenized. "smollm" (shared with starcoder/refact/codeshell) first isolates
    every \\p{N} character and then applies the GPT-2 regex; that is exactly
    the Digits(individual_digits) + ByteLevel pair in SmolLM's tokenizer.json.
    """
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"):
        # Llama-3's tokenizer.json sets ignore_merges: whole-word vocab hits win
        return _split_then_bytes(_LLAMA3_SPLIT), True
    if pre in ("qwen2", "deepseek-r1-qwen", "megrez"):
        return _split_then_bytes(_QWEN2_SPLIT), False
    if pre == "tekken":  # llama.cpp ignores merges there too: whole vocabulary hits win
        return _split_then_bytes(_TEKKEN_SPLIT), True
    if pre == "deepseek-coder":  # DeepSeek-Coder (Llama architecture): five splits, one after another
        return pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in _DEEPSEEK_CODER_SPLITS),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), False
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre): pass the model's HF "
                         "tokenizer with --tokenizer (a directory or a cached Hugging Face id)")


class Tokenizer:
    def __init__(self, backend: _Backend, *, bos_token_id: int | None,
                 eos_token_ids: list[int], chat_template: str | None = None,
                 add_bos: bool = False, add_eos: bool = False):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        # tokenizer.json may already insert BOS/EOS in its post-processor;
        # only add them by hand when it does not, to avoid doubling.
        probe = backend.encode("a", add_special_tokens=True).ids
        self._add_bos = add_bos and bos_token_id is not None and probe[:1] != [bos_token_id]
        eos0 = self.eos_token_ids[0] if self.eos_token_ids else None
        self._add_eos = add_eos and eos0 is not None and probe[-1:] != [eos0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self.bos_token_id)
            if self._add_eos:
                ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, id: int) -> str:
        """The token's own text as it would appear in output (special tokens
        written out; a partial UTF-8 byte shows as U+FFFD). For the vocabulary
        spelling (e.g. 'Ġhello') use `backend.id_to_token`."""
        return self.backend.decode([int(id)], skip_special_tokens=False)

    def save(self, directory: str) -> None:
        """tokenizer.json + tokenizer_config.json that tokenizer_from_hf_dir reads back
        to an identical tokenizer (and transformers' AutoTokenizer can read too)."""
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
               "bos_token": self.token_str(self.bos_token_id) or None,
               "eos_token": self.token_str(eos) or None,
               "add_bos_token": self._add_bos, "add_eos_token": self._add_eos,
               "chat_template": self.chat_template}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)

    def token_str(self, id: int | None) -> str:
        return "" if id is None else (self.backend.id_to_token(id) or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            template_kwargs: dict | None = None, **extra: Any) -> str:
        """The conversation as text, through chat_template (a request's) or the
        model's own (render_chat: the options, the errors)."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this model has no chat template: give one (--chat-template, LLM(chat_template=...)) "
                             "or use a plain completion prompt")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, bos_token=self.token_str(self.bos_token_id),
                           eos_token=self.token_str(eos), template_kwargs=template_kwargs, **extra)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces for streaming.

    Decoding one token at a time is wrong for byte-level vocabularies (a
    character can span tokens) and for SentencePiece ones (a leading space is
    dropped when a token is decoded alone). So each step decodes a small window
    that starts a few tokens back, and emits the text past what the window
    already produced; emission waits while the tail is an incomplete
    character. The pieces, plus `flush()`, concatenate to decode(all ids).

    Where the tokenizers library has `DecodeStream` (0.21+), its step does
    that window in Rust, one call a token instead of two decodes from Python
    (the same pieces: tests/test_model_loader.py); `use_stream=False` keeps
    the Python window.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True, use_stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        # a little prompt context keeps the first generated space intact
        self._prefix = max(len(self.ids) - 5, 0)
        self._read = len(self.ids)
        # primed with the window's ids: its first piece starts where ours does
        self._stream = (_DecodeStream(ids=self.ids[self._prefix:], skip_special_tokens=skip_special_tokens)
                        if use_stream and _DecodeStream is not None else None)

    def _text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self._stream is not None:
            piece = self._stream.step(self.tokenizer.backend, int(token_id))
            if not piece:
                return ""
            # the window moves as the stream's does, for flush()
            self._prefix, self._read = self._read, len(self.ids)
            return piece
        prefix_text = self._text(self._prefix, self._read)
        new_text = self._text(self._prefix, len(self.ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end)."""
        prefix_text = self._text(self._prefix, self._read)
        new_text = self._text(self._prefix, len(self.ids))
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]


def _first_id(backend: _Backend, token: Any) -> int | None:
    if isinstance(token, dict):  # tokenizer_config may store AddedToken dicts
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def tokenizer_from_hf_dir(path: str, eos_ids: list[int], bos_id: int | None) -> Tokenizer:
    """Read tokenizer.json (+ tokenizer_config.json / chat_template.jinja) from `path`.

    `eos_ids`/`bos_id` come from config.json and generation_config.json; the
    tokenizer config's own eos token is added to them.
    """
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ModelLoadError(f"{tok_file}: missing (only fast tokenizers are supported)")
    try:
        backend = _Backend.from_file(tok_file)
    except Exception as e:
        raise ModelLoadError(f"{tok_file}: cannot parse tokenizer ({e})") from e
    cfg: dict[str, Any] = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        try:
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{cfg_file}: cannot parse ({e})") from e
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    eos = list(eos_ids)
    cfg_eos = _first_id(backend, cfg.get("eos_token"))
    if cfg_eos is not None:
        eos.append(cfg_eos)
    cfg_bos = _first_id(backend, cfg.get("bos_token"))
    return Tokenizer(backend, bos_token_id=bos_id if bos_id is not None else cfg_bos,
                     eos_token_ids=eos, chat_template=template,
                     add_bos=bool(cfg.get("add_bos_token", False)),
                     add_eos=bool(cfg.get("add_eos_token", False)))


def _spm_backend(tokens: list[str], scores: list[float], types: list[int], space_prefix: bool) -> _Backend:
    """llama.cpp's SentencePiece tokenizer ("llama": Llama 2, Mistral, Phi-3) as
    a BPE: llama.cpp joins, again and again, the adjacent pair whose joint piece
    is in the vocabulary with the highest score, which is BPE with one merge
    per way of splitting a piece in two, ranked by that piece's score; text is
    written with "▁" for spaces and one more before each fragment; characters
    no piece covers fall back to their <0xXX> byte tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((scores[i], i, cut, left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))  # the highest-scoring piece's merges first
    unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    backend = _Backend(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=unk,
                                  fuse_unk=True, byte_fallback=True))
    # a "▁" before every stretch of text that opens the input or follows a special
    # token, as llama.cpp prefixes its fragments (normalizers run per stretch
    # between added tokens), even one that starts with a space
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * space_prefix
                                              + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + [decoders.Strip(" ", 1, 0)] * space_prefix)
    return backend


def tokenizer_from_gguf_metadata(meta: dict[str, Any], where: str) -> Tokenizer:
    """Build the tokenizer a GGUF describes; `meta` maps tokenizer.* keys to values."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(f"{where}: unsupported GGUF tokenizer model {model!r} "
                             "(byte-level BPE, 'gpt2', and SentencePiece, 'llama', are built from GGUF "
                             "metadata): pass the model's HF tokenizer with --tokenizer (a directory or a "
                             "cached Hugging Face id)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "llama":
        backend = _spm_backend(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                               bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        pre_tok, ignore_merges = _pre_tokenizer_for(meta.get("tokenizer.ggml.pre", "gpt-2"))
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                      byte_fallback=False, ignore_merges=ignore_merges))
        backend.pre_tokenizer = pre_tok
        backend.decoder = decoders.ByteLevel()
    # Control tokens (and an SPM vocabulary's <unk>) match whole in the input, as llama.cpp and HF do
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL or (ty == _UNKNOWN and model == "llama")]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    return Tokenizer(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=eos, chat_template=meta.get("tokenizer.chat_template"),
                     add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),  # SPM: BOS by default
                     add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
