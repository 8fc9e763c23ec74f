"""Tokens a request may not pick at this step, from its own parameters (vLLM's
allowed_token_ids, bad_words and min_tokens), set to -inf in its row of the
logits. The sampler bans them after it has taken the logprobs (those stay
the model's, as vLLM's default raw logprobs and as with logit_bias) and
before the token is chosen, greedy or drawn.

- allowed_token_ids: every other token.
- bad_words (tokenized at admission, engine/admission.py): a bad word's last
  token when its other tokens end the output so far, so the output never
  holds the word's token run (vLLM's rule: the prompt is not looked at).
- min_tokens: the tokens that would end the request (its stop_token_ids, and
  EOS unless ignore_eos), until min_tokens are out; without the ban the model
  would write EOS and then go on past it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from qoqserve.layers.token_mask import rows_left_empty
from qoqserve.sampling_params import SamplingParams


class BanningRequest(Protocol):
    """What the bans read of a request (engine.Sequence has it)."""
    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    bad_words_ids: tuple[tuple[int, ...], ...]

    @property
    def active_stop_bans(self) -> tuple[int, ...]:
        """The tokens that would end it, while they are banned (min_tokens not yet out)."""

    @property
    def bans_tokens(self) -> bool: ...


def banned_tokens(req: BanningRequest) -> list[int]:
    """The tokens banned at this step besides those allowed_token_ids leaves out."""
    out = len(req.token_ids) - req.num_prompt_tokens
    banned = list(req.active_stop_bans)
    for word in req.bad_words_ids:
        k = len(word) - 1
        if k <= out and (k == 0 or req.token_ids[len(req.token_ids) - k:] == list(word[:k])):
            banned.append(word[-1])
    return banned


class TokenBans:
    """The sampler's: one mask of the tokens outside allowed_token_ids per
    request that has the field (made on its first step, dropped by release())."""

    def __init__(self):
        self._outside: dict[str, torch.Tensor] = {}

    def release(self, request_id: str) -> None:
        self._outside.pop(request_id, None)

    def _outside_allowed(self, req: BanningRequest, vocab: int, device: torch.device) -> torch.Tensor:
        mask = self._outside.get(req.request_id)
        if mask is None or mask.device != device:
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            mask[torch.tensor(req.params.allowed_token_ids, dtype=torch.long, device=device)] = False
            self._outside[req.request_id] = mask
        return mask

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[BanningRequest]) -> list[int]:
        """Bans those rows' tokens in place; returns the rows left with no token."""
        ninf = float("-inf")
        for i, req in zip(rows, requests):
            if req.params.allowed_token_ids is not None:
                logits[i].masked_fill_(self._outside_allowed(req, logits.shape[1], logits.device), ninf)
            banned = banned_tokens(req)
            if banned:
                logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = ninf
        return rows_left_empty(logits, rows)
