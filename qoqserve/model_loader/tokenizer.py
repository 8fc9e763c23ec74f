"""Text <-> token ids, chat templates and streaming detokenization.

Backed by the Rust `tokenizers` library. An HF directory brings a ready
tokenizer.json; a GGUF file's tokenizer is rebuilt from its metadata in
gguf_tokenizer.py.
"""
from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as _Backend

from qoqserve.errors import ModelLoadError
from qoqserve.model_loader.chat_template import render_chat

try:  # tokenizers 0.21+
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:
    _DecodeStream = None

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
        # SentencePiece-style decoding (IncrementalDetokenizer streams it with the Python window)
        self.byte_fallback = backend.decoder is not None and b"ByteFallback" in backend.decoder.__getstate__()

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
        # primed with the window's ids: its first piece starts where ours does. Not
        # with byte fallback (SentencePiece): a window that starts inside a
        # character's bytes led its prefix check astray (tests/test_gguf_tokenizers.py)
        use_stream = use_stream and _DecodeStream is not None and not tokenizer.byte_fallback
        self._stream = (_DecodeStream(ids=self.ids[self._prefix:], skip_special_tokens=skip_special_tokens)
                        if use_stream else None)

    def _text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tokenizer.backend, int(token_id))
            except Exception:  # its prefix check fails where bytes that were not text become text
                self._stream = None  # (SentencePiece byte fallback): the Python window from here on
            else:
                if not piece:
                    return ""
                # the window moves as the stream's does, for flush() and a fall back
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
    """Read tokenizer.json (+ tokenizer_config.json / chat_template.json / chat_template.jinja) from `path`.

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
    processor_file = os.path.join(path, "chat_template.json")  # where multimodal checkpoints keep it (Gemma 3)
    if template is None and os.path.isfile(processor_file):
        try:
            with open(processor_file, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{processor_file}: cannot parse ({e})") from e
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
