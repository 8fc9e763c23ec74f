"""Greedy agreement: the share of chat prompts whose first K greedy tokens
are the reference (FP) model's.

The reference generates once; a tested model then scores prompt + the
reference's tokens in one pass. Its greedy continuation equals the
reference's exactly when its argmax at every one of those rows is the
reference's token (each greedy step would see the very tokens forced here
up to the first disagreement), so no tested model needs to decode.
"""
from __future__ import annotations

from dataclasses import dataclass

from qoqserve.eval.subject import LogitsFn

# our own prompts: short everyday requests with one natural answer each
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "How many days are in a week?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Explain in one sentence what a thermometer measures.",
    "List the first five even numbers.",
    "What is the opposite of cold?",
    "Suggest a name for a small orange cat.",
    "What language is spoken in Brazil?",
    "Describe a sunset in a few words.",
    "What is two plus three?",
    "Why do people use umbrellas?",
    "Translate 'thank you' into Spanish.",
    "Tell me a fun fact about elephants.",
)


@dataclass
class AgreementResult:
    rate: float            # prompts whose first K tokens all agree
    mean_prefix: float     # mean share of the K tokens agreed before the first difference
    num_prompts: int
    k: int


def chat_prompt_ids(tokenizer, prompts=CHAT_PROMPTS) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                             add_special_tokens=False) for p in prompts]


def agreed_prefix(logits_fn: LogitsFn, prompt: list[int], reference: list[int]) -> int:
    """How many of the reference's tokens the tested model's greedy choice
    reproduces before its first different one."""
    rows = list(range(len(prompt) - 1, len(prompt) - 1 + len(reference)))
    picks = logits_fn(prompt + reference, rows).argmax(-1).tolist()
    n = 0
    while n < len(reference) and picks[n] == reference[n]:
        n += 1
    return n


def greedy_agreement(logits_fn: LogitsFn, prompts: list[list[int]],
                     references: list[list[int]], k: int) -> AgreementResult:
    """references: the reference's greedy continuations (up to k tokens, fewer
    where it stopped at EOS: then the EOS must agree too)."""
    shares = []
    for prompt, ref in zip(prompts, references):
        ref = ref[:k]
        shares.append(agreed_prefix(logits_fn, prompt, ref) / len(ref))
    return AgreementResult(sum(s == 1.0 for s in shares) / len(shares), sum(shares) / len(shares),
                           len(shares), k)
