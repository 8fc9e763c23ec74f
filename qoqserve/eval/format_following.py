"""Format following: prompts that ask for a JSON object with given keys; the
rate of replies that hold such an object (free greedy generation, no
constrained decoding: this measures the model, not a grammar).

A reply passes when it contains a JSON object (optionally in a ``` fence or
after a few words) that parses and has every asked key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from qoqserve.eval.subject import GenerateFn

# our own prompts: (request, keys it asks for)
JSON_TASKS = (
    ("a fictional book", ("title", "author", "year")),
    ("a city you would like to visit", ("city", "country")),
    ("a pet", ("name", "species", "age")),
    ("a recipe for a simple salad", ("name", "ingredients")),
    ("a made-up person", ("first_name", "last_name", "age")),
    ("the weather on a sunny day", ("temperature", "condition")),
    ("a movie you like", ("title", "year", "genre")),
    ("a fruit", ("name", "color")),
    ("a car", ("make", "model", "year")),
    ("a song", ("title", "artist")),
    ("a planet of the solar system", ("name", "moons")),
    ("a birthday party", ("date", "guests", "place")),
)
MAX_NEW_TOKENS = 96


@dataclass
class FormatResult:
    rate: float            # replies holding a JSON object with every asked key
    parsed: float          # replies holding any JSON object
    num_prompts: int
    replies: list[str]


def task_prompt(subject: str, keys) -> str:
    names = ", ".join(f'"{k}"' for k in keys)
    return (f"Describe {subject} as a JSON object with exactly these keys: {names}. "
            "Reply with the JSON object only.")


def prompt_ids(tokenizer, tasks=JSON_TASKS) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": task_prompt(s, keys)}]), add_special_tokens=False)
        for s, keys in tasks]


def first_json_object(text: str) -> dict | None:
    """The first JSON object in text (decoding from each '{' in turn)."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None


def score_replies(replies: list[str], tasks=JSON_TASKS) -> FormatResult:
    objs = [first_json_object(r) for r in replies]
    ok = [o is not None and all(k in o for k in keys) for o, (_, keys) in zip(objs, tasks)]
    return FormatResult(sum(ok) / len(ok), sum(o is not None for o in objs) / len(objs), len(ok), replies)


def format_following(generate_fn: GenerateFn, tokenizer, tasks=JSON_TASKS,
                     max_new_tokens: int = MAX_NEW_TOKENS) -> FormatResult:
    outs = generate_fn(prompt_ids(tokenizer, tasks), max_new_tokens)
    return score_replies([tokenizer.decode(o) for o in outs], tasks)
