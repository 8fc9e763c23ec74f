"""Per-request sampling settings, validated once when the request is created."""
from __future__ import annotations

from dataclasses import dataclass, field

from qoqserve.errors import InvalidRequestError


class InvalidSamplingParams(InvalidRequestError):
    """A sampling parameter out of range; `param` names it."""


@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1            # -1 (or 0) disables
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(msg: str):
            raise InvalidSamplingParams(msg, param=msg.split()[0])

        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            # torch generators take 64-bit seeds; a larger one must fail here, not mid-step
            bad(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if (not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool)
                or not 0 <= self.top_logprobs <= 20):
            bad(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            bad("top_logprobs needs logprobs")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
