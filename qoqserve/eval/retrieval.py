"""Pass-key retrieval: a 5-digit key hidden at some depth of a long filler
text, asked for at the end (the pass-key test of Landmark Attention /
LongLoRA, with our own filler: eval/filler.py). Two protocols:

- forced (`passkey`): the needle states the key twice, the assistant's reply
  is forced to start with "The pass key is ", and the case counts as found
  when the model's greedy choice at each of the key's digits is that digit.
  Scoring the digits with the reply forced (teacher forcing) equals greedy
  generation of them: each greedy step sees exactly the tokens forced here
  until the first wrong digit, so one prompt pass decides a case, at the
  digit rows only (no [len, vocab] logits).
- free (`passkey-free`), as a user would ask: the needle states the key
  once, the question ends the user's turn, and the model writes its whole
  reply greedily (24 tokens at most); found when the reply holds the key.
  Harder: the model must choose to answer with the number, not only copy
  digits after a forced prefix.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from qoqserve.eval.filler import filler_pieces
from qoqserve.eval.subject import GenerateFn, LogitsFn

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
INSTRUCTION = ("There is a pass key hidden in the text below. Find it and remember it, "
               "I will ask you for it at the end.")
QUESTION = "What is the pass key? Answer with the number only."
REPLY_PREFIX = "The pass key is "
# the free protocol: the needle once, no reply prefix, the reply generated
FREE_INSTRUCTION = "There is a pass key hidden in the text below. Find it and remember it."
FREE_QUESTION = "What is the pass key?"
FREE_KEYS_PER_DEPTH = 4
FREE_MAX_NEW_TOKENS = 24


@dataclass
class PasskeyCase:
    length: int               # prompt length in tokens: len(ids) <= length, within a few
    depth: float              # where the needle sits, as a fraction of the filler
    key: str
    ids: list[int]            # prompt + reply prefix + key
    key_rows: list[int]       # rows whose next-token logits must pick the key's digits

    @property
    def key_ids(self) -> list[int]:
        return [self.ids[r + 1] for r in self.key_rows]


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def _needle_once(key: str) -> str:
    return f"The pass key is {key}. Remember it. "


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _chat_prompt(tokenizer, instruction: str, haystack: str, question: str) -> str:
    msg = f"{instruction}\n\n{haystack}\n\n{question}"
    return tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)


def _fit(tokenizer, length: int, depth: float, needle: str, seed: int, render) -> tuple[str, list[int]]:
    """render(haystack) -> the whole text; the haystack is filler with the
    needle at the sentence boundary nearest `depth`, as long as fits in
    `length` tokens. Returns the text and its ids."""
    budget = length - len(_ids(tokenizer, render(needle)))
    while True:  # the sentence-by-sentence count is a little off: trim until it fits
        if budget < 16:
            raise ValueError(f"pass-key length {length} leaves no room for filler")
        sentences, counts = filler_pieces(tokenizer, budget, seed)
        cum, at = 0, len(sentences)
        for i, c in enumerate(counts):
            if cum >= depth * budget:
                at = i
                break
            cum += c
        text = render("".join(sentences[:at] + [needle] + sentences[at:]).strip())
        ids = _ids(tokenizer, text)
        if len(ids) <= length:
            return text, ids
        budget -= len(ids) - length


def build_case(tokenizer, length: int, depth: float, key: str, seed: int) -> PasskeyCase:
    def render(haystack: str) -> str:
        return _chat_prompt(tokenizer, INSTRUCTION, haystack, QUESTION) + REPLY_PREFIX + key

    text, full = _fit(tokenizer, length, depth, _needle(key), seed, render)
    head = _ids(tokenizer, text[:-len(key)])
    if full[:len(head)] != head or len(full) - len(head) != len(key):
        raise ValueError("the key does not tokenize as one token per digit after the reply prefix")
    return PasskeyCase(length, depth, key, full, list(range(len(head) - 1, len(full) - 1)))


def _draw(make, lengths, depths, keys_per_depth: int, rng: random.Random) -> list:
    """make(length, depth, key, filler seed) for every (length, depth) and
    keys_per_depth keys, the keys and filler seeds drawn from rng in turn."""
    return [make(length, depth, str(rng.randint(10000, 99999)), rng.randint(0, 2**31))
            for length in lengths for depth in depths for _ in range(keys_per_depth)]


def build_cases(tokenizer, lengths=DEFAULT_LENGTHS, depths=DEFAULT_DEPTHS, keys_per_depth: int = 2,
                seed: int = 0) -> list[PasskeyCase]:
    """Every (length, depth) with keys_per_depth keys; the keys and the filler
    are drawn from seed, so every configuration answers the same cases."""
    return _draw(lambda *a: build_case(tokenizer, *a), lengths, depths, keys_per_depth, random.Random(seed))


@dataclass
class FreePasskeyCase:
    length: int
    depth: float
    key: str
    ids: list[int]            # the chat prompt, up to the assistant turn's start


def build_free_case(tokenizer, length: int, depth: float, key: str, seed: int) -> FreePasskeyCase:
    _, ids = _fit(tokenizer, length, depth, _needle_once(key), seed,
                  lambda haystack: _chat_prompt(tokenizer, FREE_INSTRUCTION, haystack, FREE_QUESTION))
    return FreePasskeyCase(length, depth, key, ids)


def build_free_cases(tokenizer, lengths=DEFAULT_LENGTHS, depths=DEFAULT_DEPTHS,
                     keys_per_depth: int = FREE_KEYS_PER_DEPTH, seed: int = 0) -> list[FreePasskeyCase]:
    """As build_cases, for the free protocol (its own draw of keys and filler)."""
    return _draw(lambda *a: build_free_case(tokenizer, *a), lengths, depths, keys_per_depth,
                 random.Random(seed + 1))


def _per_length(cases, hits) -> dict[int, float]:
    """Share of cases found, per length."""
    by_length: dict[int, list[bool]] = {}
    for case, hit in zip(cases, hits):
        by_length.setdefault(case.length, []).append(hit)
    return {length: sum(h) / len(h) for length, h in by_length.items()}


def free_reply_finds(reply: str, key: str) -> bool:
    """The key as a number of its own in the reply (not inside a longer one)."""
    return re.search(rf"(?<!\d){key}(?!\d)", reply) is not None


def free_passkey_accuracy(generate_fn: GenerateFn, tokenizer, cases: list[FreePasskeyCase],
                          max_new_tokens: int = FREE_MAX_NEW_TOKENS,
                          batch: int = 8) -> tuple[dict[int, float], list[str]]:
    """Share of cases whose free greedy reply holds the key, per length, and
    the replies (in case order). Prompts go `batch` at a time: a subject's
    generate prefills a whole batch in one pass."""
    replies = []
    for i in range(0, len(cases), batch):
        outs = generate_fn([c.ids for c in cases[i:i + batch]], max_new_tokens)
        replies += [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    return _per_length(cases, [free_reply_finds(r, c.key) for c, r in zip(cases, replies)]), replies


def found(logits_fn: LogitsFn, case: PasskeyCase) -> bool:
    logits = logits_fn(case.ids, case.key_rows)
    return logits.argmax(-1).tolist() == case.key_ids


def passkey_accuracy(logits_fn: LogitsFn, cases: list[PasskeyCase]) -> dict[int, float]:
    """Share of cases found, per length."""
    return _per_length(cases, [found(logits_fn, c) for c in cases])
