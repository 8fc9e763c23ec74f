"""A request's state as the scheduler sees it: plain Python, no tensors."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from qoqserve.layers.token_mask import TokenConstraint
from qoqserve.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0     # prefix tokens found in the page cache at allocation
    # tokens whose K/V are in the pages (cached ones included); a prompt is
    # prefilled in chunks until all are, then each step adds one
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0     # leading full blocks registered in the prefix cache
    # leading blocks given back before its window (every layer slides), or
    # whose sliding layers' pages were (engine/window_pages.py); their ids stay in block_table
    num_released_blocks: int = 0
    # with a pool for the sliding layers: it holds their pages of the blocks
    # from num_released_blocks up to this one
    num_window_blocks: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_preemptions: int = 0
    priority: int = 0  # the priority policy's order: lower first (vLLM's)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted to a step (queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # token-count bookkeeping for presence/frequency penalties
    output_counts: dict[int, int] = field(default_factory=dict)
    # structured outputs: a grammar matcher that has accepted every output token
    # so far (engine/structured.py); a preempted sequence keeps it, since
    # recomputing changes no token
    constraint: TokenConstraint | None = None
    # the token runs of its bad_words (engine/admission.py), and the tokens that
    # would end it, banned until min_tokens are out (layers/token_bans.py)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    stop_bans: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def bans_tokens(self) -> bool:
        """Its next token has tokens banned (layers/token_bans.py)."""
        return bool(self.params.allowed_token_ids or self.bad_words_ids or self.active_stop_bans)

    @property
    def takes_argmax(self) -> bool:
        """Its next token is the argmax of the model's logits and nothing else
        of them is wanted: greedy, no penalties or logprobs, no grammar, no
        banned tokens (the sampler's shortcut, the drafts of engine/speculative.py)."""
        return self.params.plain_greedy and self.constraint is None and not self.bans_tokens

    @property
    def verifies_drafts(self) -> bool:
        """Its token after each draft (engine/speculative.py) can be chosen, and
        its logprobs taken, as a plain step would there: nothing but the
        logits, its sampling params and its own tokens, drafts included,
        decides it (no grammar, no banned tokens; penalties read its tokens)."""
        return self.constraint is None and not self.bans_tokens

    @property
    def active_stop_bans(self) -> tuple[int, ...]:
        """The stop tokens banned at its next token: all of stop_bans until min_tokens are out."""
        return self.stop_bans if self.num_output_tokens < self.params.min_tokens else ()

    @property
    def is_prefilling(self) -> bool:
        """Tokens beyond the newest one are still to be computed (a preempted
        sequence being recomputed), or any of the prompt's: a prompt's last
        token is computed in a prefill chunk even when it is all that is left
        (chunking, or a prefix-cache hit up to it), as when the prompt runs
        whole, never as a decode (another attention kernel, another sum order)."""
        return self.num_computed_tokens < max(self.num_prompt_tokens, len(self.token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return -(-len(self.token_ids) // block_size)

    def slot(self, pos: int, block_size: int) -> int:
        """The flat KV slot (page * block_size + offset) of token `pos`."""
        return self.block_table[pos // block_size] * block_size + pos % block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append(self, token_id: int, logprob: float | None = None,
               top: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        if logprob is not None:
            self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
