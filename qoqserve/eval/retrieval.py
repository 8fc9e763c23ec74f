"""Pass-key retrieval: a 5-digit key hidden at some depth of a long filler
text, asked for at the end (the pass-key test of Landmark Attention /
LongLoRA, with our own filler: eval/filler.py).

The prompt is a chat turn; the assistant's reply starts with "The pass key
is " and the case counts as found when the model's greedy choice at each of
the key's digits is that digit. Scoring the digits with the reply forced
(teacher forcing) equals greedy generation of them: each greedy step sees
exactly the tokens forced here until the first wrong digit, so one prompt
pass decides a case, at the digit rows only (no [len, vocab] logits).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from qoqserve.eval.filler import filler_pieces
from qoqserve.eval.subject import LogitsFn

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
INSTRUCTION = ("There is a pass key hidden in the text below. Find it and remember it, "
               "I will ask you for it at the end.")
QUESTION = "What is the pass key? Answer with the number only."
REPLY_PREFIX = "The pass key is "


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


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def build_case(tokenizer, length: int, depth: float, key: str, seed: int) -> PasskeyCase:
    def prompt(haystack: str) -> str:
        msg = f"{INSTRUCTION}\n\n{haystack}\n\n{QUESTION}"
        return tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                             add_generation_prompt=True) + REPLY_PREFIX

    budget = length - len(_ids(tokenizer, prompt(_needle(key)))) - len(key)
    while True:  # the sentence-by-sentence count is a little off: trim until it fits
        if budget < 16:
            raise ValueError(f"pass-key length {length} leaves no room for filler")
        sentences, counts = filler_pieces(tokenizer, budget, seed)
        # the needle goes in at the sentence boundary nearest the asked depth
        cum, at = 0, len(sentences)
        for i, c in enumerate(counts):
            if cum >= depth * budget:
                at = i
                break
            cum += c
        text = prompt("".join(sentences[:at] + [_needle(key)] + sentences[at:]).strip())
        head, full = _ids(tokenizer, text), _ids(tokenizer, text + key)
        if len(full) <= length:
            break
        budget -= len(full) - length
    if full[:len(head)] != head or len(full) - len(head) != len(key):
        raise ValueError("the key does not tokenize as one token per digit after the reply prefix")
    return PasskeyCase(length, depth, key, full, list(range(len(head) - 1, len(full) - 1)))


def build_cases(tokenizer, lengths=DEFAULT_LENGTHS, depths=DEFAULT_DEPTHS, keys_per_depth: int = 2,
                seed: int = 0) -> list[PasskeyCase]:
    """Every (length, depth) with keys_per_depth keys; the keys and the filler
    are drawn from seed, so every configuration answers the same cases."""
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for depth in depths:
            for _ in range(keys_per_depth):
                key = str(rng.randint(10000, 99999))
                cases.append(build_case(tokenizer, length, depth, key, rng.randint(0, 2**31)))
    return cases


def found(logits_fn: LogitsFn, case: PasskeyCase) -> bool:
    logits = logits_fn(case.ids, case.key_rows)
    return logits.argmax(-1).tolist() == case.key_ids


def passkey_accuracy(logits_fn: LogitsFn, cases: list[PasskeyCase]) -> dict[int, float]:
    """Share of cases found, per length."""
    hits: dict[int, list[bool]] = {}
    for case in cases:
        hits.setdefault(case.length, []).append(found(logits_fn, case))
    return {length: sum(h) / len(h) for length, h in hits.items()}
