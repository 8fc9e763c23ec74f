"""GGUF tokenizers built from the file's metadata (model_loader/gguf_tokenizer.py)
against llama.cpp's own: what llama.cpp 0.3.36's server answered is kept in
tests/data/. SentencePiece ("llama": Llama 2, Mistral, Phi-3), 64 texts
(special tokens inside, characters no piece covers, leading and repeated
spaces) over the vocabulary built here, and 20 without the space prefix;
the "tekken" (Mistral), "deepseek-coder", "gpt-4o" (Phi-4-mini, Llama 4) and
"deepseek-llm" pre-tokenizers, 30 texts each
over the embedded model's vocabulary, texts whose tokens differ under every
other split. scripts/gguf_tokenizer_fixtures.py makes them (and compares
thousands of random texts: docs/models.md)."""
import json
import random
from pathlib import Path

import pytest

from qoqserve.errors import ModelLoadError
from qoqserve.model_loader.gguf_tokenizer import tokenizer_from_gguf_metadata

CASES = json.loads((Path(__file__).parent / "data" / "spm_llamacpp_tokens.json").read_text())


def spm_metadata(seed: int = 0) -> dict:
    """A small SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte tokens,
    single characters scored lowest, and word pieces with random scores (so
    which pair joins first is decided by the scores, as in a real one)."""
    rng = random.Random(seed)
    head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)] + [(f"<0x{b:02X}>", 6) for b in range(256)]
    pieces = set("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-é")
    for w in ["the", "and", "ing", "tion", "of", "is", "it", "in", "an", "er", "re", "on", "at", "es", "en", "ed",
              "st", "th", "he", "wh", "ha", "hello", "world", "token", "izer", "pie", "ce", "piece", "Hel", "lo",
              "123", "12", "23", "..", "!?", "é", "ét", "été"]:
        for k in range(2, len(w) + 1):
            pieces.add(w[:k])
            pieces.add("▁" + w[:k])
    for a in "aeiou":
        for b in "nrstl":
            pieces.add(a + b)
            pieces.add(b + a)
    body = sorted(pieces)
    scores = [0.0] * len(head) + [(-1000.0 - i if len(p) == 1 else -rng.uniform(0, 100)) for i, p in enumerate(body)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [t for t, _ in head] + body,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": [ty for _, ty in head] + [1] * len(body),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


@pytest.fixture(scope="module")
def tok():
    return tokenizer_from_gguf_metadata(spm_metadata(), "spm.gguf")


@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: repr(c["text"])[:30])
def test_encode_and_decode_as_llama_cpp(tok, case):
    assert tok.encode(case["text"], add_special_tokens=False) == case["tokens"]
    # llama.cpp keeps the first piece's "▁" as a space; we drop it, as HF does (the
    # streaming detokenizer decodes with the tokens before, so output keeps it)
    want = case["detokenized"]
    assert tok.decode(case["tokens"], skip_special_tokens=False) in (want, want[1:] if want[:1] == " " else want)


@pytest.mark.parametrize("case", CASES["no_space_prefix_cases"], ids=lambda c: repr(c["text"])[:30])
def test_without_the_space_prefix_as_llama_cpp(case):
    """tokenizer.ggml.add_space_prefix false (SentencePiece models without a dummy prefix)."""
    tok = tokenizer_from_gguf_metadata({**spm_metadata(), "tokenizer.ggml.add_space_prefix": False}, "x.gguf")
    assert tok.encode(case["text"], add_special_tokens=False) == case["tokens"]
    assert tok.decode(case["tokens"], skip_special_tokens=False) == case["detokenized"]


def test_bos_by_default_and_the_special_tokens(tok):
    assert tok.encode("hi") == CASES["bos_hi"] and tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    ids = tok.encode("hello </s> world", add_special_tokens=False)
    assert 2 in ids and "</s>" not in tok.decode(ids) and "</s>" in tok.decode(ids, skip_special_tokens=False)


def test_another_tokenizer_model_is_refused_naming_the_way_out():
    with pytest.raises(ModelLoadError, match="--tokenizer"):
        tokenizer_from_gguf_metadata({**spm_metadata(), "tokenizer.ggml.model": "t5"}, "x.gguf")


def with_probe_tokens(meta: dict) -> dict:
    """The embedded model's vocabulary (single digits only) plus a token for
    every run of two and three digits and the merges that make them, and
    words across a change of case with no merges: where a pre-tokenizer groups
    digits by three (gpt-4o, llama-bpe) its tokens then differ from one that
    splits them one by one (tekken), and where it keeps such a word whole and
    takes vocabulary hits whole (llama-bpe) from one that splits it at the
    case (gpt-4o)."""
    groups = [f"{a}{b}" for a in range(10) for b in range(10)] + [f"{a}{b}{c}" for a in range(10) for b in range(10)
                                                                for c in range(10)]
    merges = [f"{g[0]} {g[1]}" if len(g) == 2 else f"{g[:2]} {g[2]}" for g in groups]
    words = ["camelCase", "isTheBest", "getURL", "abcDEF", "ĠcamelCase"]
    return {**meta, "tokenizer.ggml.tokens": list(meta["tokenizer.ggml.tokens"]) + groups + words,
            "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"]) + [1] * (len(groups) + len(words)),
            "tokenizer.ggml.merges": list(meta["tokenizer.ggml.merges"]) + merges}


def _cases(name: str) -> list:
    return json.loads((Path(__file__).parent / "data" / f"{name}_llamacpp_tokens.json").read_text())["cases"]


@pytest.fixture(scope="module")
def smollm2_with(default_gguf_path):
    """The embedded model's vocabulary under another pre-tokenizer, built once each."""
    from qoqserve.model_loader.gguf_header import read_gguf_header

    meta, built = read_gguf_header(default_gguf_path)[0], {}

    def tokenizer(pre: str):
        if pre not in built:
            vocab = with_probe_tokens(meta) if pre == "gpt-4o" else meta  # as its fixture was made
            built[pre] = tokenizer_from_gguf_metadata({**vocab, "tokenizer.ggml.pre": pre}, f"{pre}.gguf")
        return built[pre]
    return tokenizer


@pytest.mark.parametrize("pre,case", [("tekken", c) for c in _cases("tekken")]
                         + [("deepseek-coder", c) for c in _cases("deepseek_coder")]
                         + [("gpt-4o", c) for c in _cases("gpt4o")]
                         + [("deepseek-llm", c) for c in _cases("deepseek_llm")],
                         ids=lambda v: v if isinstance(v, str) else repr(v["text"])[:30])
def test_byte_level_pre_tokenizers_split_as_llama_cpp(smollm2_with, pre, case):
    """Mistral Nemo / Small 3 ("tekken": capitalised words, single digits, no
    merges across a vocabulary hit), DeepSeek-Coder ("deepseek-coder": five
    splits in turn), Phi-4-mini / Llama 4 ("gpt-4o": tekken's words with
    contractions, digits in threes) and DeepSeek-LLM ("deepseek-llm": six
    splits in turn) over the embedded model's vocabulary; most cases are texts
    whose tokens differ under every other split."""
    assert smollm2_with(pre).encode(case["text"], add_special_tokens=False) == case["tokens"]


def test_streamed_text_of_a_sentencepiece_model_is_its_decoded_text(tok):
    """The serving detokenizer over byte-fallback pieces: text that is text
    streams exactly as decode() writes it, with the prompt's last tokens as
    context (even where they cut a character's bytes: Rust's DecodeStream got
    one such case of these 1,000 wrong, so byte-fallback tokenizers take the
    Python window); random tokens that are not UTF-8 never raise."""
    from qoqserve.model_loader.tokenizer import IncrementalDetokenizer

    rng = random.Random(1)
    alphabet = list("abcdefghij ") * 3 + ["é", "中", "😀", "\n", "  ", "hello", "été"]
    for _ in range(1000):
        prompt = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10))))
        out = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))), add_special_tokens=False)
        d = IncrementalDetokenizer(tok, prompt)
        assert "".join(d.add(t) for t in out) + d.flush() == tok.decode(prompt + out)[len(tok.decode(prompt)):]
    for _ in range(200):
        out = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(1, 20))]
        pieces = [IncrementalDetokenizer(tok, [1, 300], use_stream=s) for s in (True, False)]
        texts = ["".join(d.add(t) for t in out) + d.flush() for d in pieces]
        assert texts[0] == texts[1]


def test_a_stream_that_fails_its_prefix_check_falls_back_to_the_python_window(tok, monkeypatch):
    """Were a tokenizer's stream decoder to raise mid-request (Rust's
    DecodeStream does over invalid bytes with byte fallback), the request goes
    on with the Python window: the same text, no error."""
    from qoqserve.model_loader import tokenizer as tokenizer_module

    monkeypatch.setattr(tok, "byte_fallback", False)
    rng, fell = random.Random(3), 0
    for _ in range(200):
        out = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(1, 20))]
        streamed = tokenizer_module.IncrementalDetokenizer(tok, [1, 300])
        window = tokenizer_module.IncrementalDetokenizer(tok, [1, 300], use_stream=False)
        texts = ["".join(d.add(t) for t in out) + d.flush() for d in (streamed, window)]
        fell += streamed._stream is None
        assert texts[0] == texts[1]
    assert fell > 10  # the fall back was taken
