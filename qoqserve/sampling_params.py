"""Per-request sampling settings, validated and normalized once when the
request is created: after __post_init__ every field holds a value of its
declared type inside its range, so nothing downstream (the sampler, a torch
generator, the detokenizer) can be handed a value it would choke on mid-step.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from qoqserve.errors import InvalidRequestError

# (low, high, low is exclusive) of each numeric field; the HTTP schemas
# publish the same bounds, so the two cannot drift apart
FLOAT_RANGES = {
    "temperature": (0.0, 100.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
}
# torch generators take any 64-bit seed, signed or not; one beyond that
# overflowed inside a step and took the whole batch down with it
SEED_RANGE = (-2**63, 2**64 - 1)
MAX_TOP_LOGPROBS = 20


class InvalidSamplingParams(InvalidRequestError):
    """A sampling parameter out of range; `param` names it."""


def is_valid_text(s: str) -> bool:
    """Encodable as UTF-8: no lone surrogates (JSON's "\\ud800" decodes to one,
    and the tokenizer and every response writer would fail on it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# StructuredOutputs' kinds, one of which a spec sets (vLLM's field names)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputs:
    """What the output must match (vLLM's StructuredOutputsParams): exactly one
    of a JSON schema, any JSON object, a regex, a list of choices, an EBNF
    (GBNF-style) grammar or an xgrammar structural tag. After __post_init__
    `json` and `structural_tag` hold JSON text and `choice` a tuple, so
    key() is the same for equal specs (the grammar cache's key)."""
    json: str | dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        def bad(msg: str, param: str):
            raise InvalidSamplingParams(msg, param=f"structured_outputs.{param}")

        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            bad(f"set exactly one of {', '.join(STRUCTURED_KINDS)} (got {', '.join(given) or 'none'})",
                given[1] if len(given) > 1 else "json")
        for name in ("json", "structural_tag"):
            v = getattr(self, name)
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as e:
                    bad(f"{name} is not valid JSON: {e}", name)
            if v is not None:
                if not isinstance(v, (dict, bool)) or (name == "structural_tag" and not isinstance(v, dict)):
                    bad(f"{name} must be a JSON {'schema' if name == 'json' else 'object'}", name)
                setattr(self, name, json.dumps(v, ensure_ascii=False))
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and is_valid_text(c) for c in self.choice)):
                bad("choice must be a non-empty list of strings", "choice")
            self.choice = tuple(self.choice)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v and is_valid_text(v)):
                bad(f"{name} must be a non-empty string", name)
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false", name)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        return (self.kind, getattr(self, self.kind), self.disable_any_whitespace)


@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1            # -1 (or 0) disables
    min_p: float = 0.0         # drop tokens below min_p x the top token's probability (0 disables)
    max_tokens: int | None = 16  # None: until the context window is full
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False     # return the log-probability of each chosen token
    top_logprobs: int = 0      # with logprobs: also the k most likely tokens at each step
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: the output text spells special tokens (e.g. <|im_end|>) out
    structured_outputs: StructuredOutputs | None = None  # constrain the output (a grammar)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be picked
    bad_words: list[str] | None = None  # vLLM's: words the output must not hold (as whole token runs)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: all that fit)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise InvalidSamplingParams("stop must be a string or a list of strings", param="stop")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidSamplingParams("stop_token_ids must be a list of integers", param="stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("allowed_token_ids", "bad_words"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                raise InvalidSamplingParams(f"{name} must be a list", param=name)
            setattr(self, name, None if v is None else list(v))
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidSamplingParams("logit_bias must map token ids to numbers", param="logit_bias")
        self.validate()
        self.bad_words = self.bad_words or None  # an empty list is none
        if self.logit_bias is not None:  # an empty one is none
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        for name in FLOAT_RANGES:  # ints are accepted, floats are stored
            setattr(self, name, float(getattr(self, name)))
        if self.top_k == 0:
            self.top_k = -1

    def validate(self) -> None:
        def bad(msg: str):
            raise InvalidSamplingParams(msg, param=msg.split()[0])

        for name, (lo, hi, open_lo) in FLOAT_RANGES.items():
            v = getattr(self, name)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (lo < v if open_lo else lo <= v) and v <= hi)
            if not ok:
                bad(f"{name} must be a number in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {v!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for t, b in (self.logit_bias or {}).items():
            if not _is_int(t) or t < 0:
                raise InvalidSamplingParams(f"logit_bias keys must be token ids (integers >= 0), got {t!r}",
                                            param="logit_bias")
            if not (isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100):
                raise InvalidSamplingParams(f"logit_bias values must be numbers in [-100, 100], got {b!r}",
                                            param="logit_bias")
        if self.allowed_token_ids is not None and not (
                self.allowed_token_ids and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and not all(
                isinstance(w, str) and w.strip() and is_valid_text(w) for w in self.bad_words):
            bad("bad_words must be a list of strings holding more than white space")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1
                                                             or self.truncate_prompt_tokens == -1)):
            bad(f"truncate_prompt_tokens must be -1 (all that fit) or a positive integer, "
                f"got {self.truncate_prompt_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad(f"seed must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if not all(is_valid_text(s) for s in self.stop):
            bad("stop strings must be valid Unicode text (no lone surrogates)")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            bad("top_logprobs needs logprobs")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidSamplingParams("structured_outputs must be a StructuredOutputs",
                                        param="structured_outputs")
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the model's logits is the token, and nothing else of
        them is wanted (no penalties, no logprobs)."""
        return self.greedy and self.burstable and not self.logprobs and not self.has_penalties

    @property
    def burstable(self) -> bool:
        """Its token is a decode burst's to choose in C: the step's argmax or a
        plain draw (temperature, min_p, top_k, top_p), after its penalties
        (engine/burst_penalties.py says which fit) or with its logprobs; no
        banned tokens (min_tokens is the sequence's to judge:
        engine.Sequence.bans_tokens)."""
        return not self.allowed_token_ids and not self.bad_words

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))
