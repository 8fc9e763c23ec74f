"""A GGUF file's tokenizer, rebuilt from its metadata (vocabulary, merges or
SentencePiece scores, token types, the pre-tokenizer's name) as llama.cpp
tokenizes it: tests/test_gguf_tokenizers.py holds it to llama.cpp's answers."""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from qoqserve.errors import ModelLoadError

from .tokenizer import Tokenizer

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
# OpenAI's o200k as Phi-4-mini and Llama 4 ship it ("gpt-4o"): tekken's words with
# their contractions, and up to three digits at a time
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-LLM (7B/67B, Llama architecture): six splits in turn, as llama.cpp
# lists them (its letters and punctuation as explicit ranges)
_DEEPSEEK_LLM_LETTERS = (
    '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-'
    'ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ'
    '-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ'
    '-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+')
_DEEPSEEK_LLM_SPLITS = (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+', r"\s+$",
                        "[一-龥ࠀ-一가-퟿]+", r"\p{N}+")
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
    if pre in ("gpt-4o", "llama4"):
        return _split_then_bytes(_GPT4O_SPLIT), False
    if pre in ("deepseek-coder", "deepseek-llm"):  # DeepSeek (Llama architecture): splits one after another
        splits = _DEEPSEEK_CODER_SPLITS if pre == "deepseek-coder" else _DEEPSEEK_LLM_SPLITS
        return pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), False
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre): pass the model's HF "
                         "tokenizer with --tokenizer (a directory or a cached Hugging Face id)")


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
