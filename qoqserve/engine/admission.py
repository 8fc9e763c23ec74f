"""Request admission: every request's prompt and parameters are checked and
normalized here, once, before it enters the scheduler. The engine raises
InvalidRequestError (with the offending `param` and an OpenAI `code`), which
the HTTP server maps to a 400 and the Python API raises as is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qoqserve.engine.structured import GrammarCompiler
from qoqserve.errors import InvalidRequestError
from qoqserve.model_loader.tokenizer import Tokenizer
from qoqserve.sampling_params import SamplingParams, is_valid_text


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed admission: token ids, final parameters and, for
    structured outputs, the compiled grammar."""
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: Any = None  # xgrammar.CompiledGrammar
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # each bad word's token runs (bad_words_ids())
    priority: int = 0  # the priority policy's order: lower first


class Admission:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 max_prompt_tokens: int | None = None, max_tokens_limit: int | None = None,
                 grammars: GrammarCompiler | None = None, defaults: dict | None = None,
                 by_priority: bool = False):
        self.tokenizer = tokenizer
        self.by_priority = by_priority  # the scheduler orders by priority (else every priority must be 0)
        self.defaults = defaults or {}  # SamplingParams fields of a request that brings none
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # a prompt plus at least one generated token must fit the context window
        self.max_prompt_tokens = min(max_prompt_tokens or max_model_len, max_model_len - 1)
        self.max_tokens_limit = max_tokens_limit or max_model_len

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not is_valid_text(prompt):
                raise InvalidRequestError("the prompt is not valid Unicode text (it holds a lone surrogate)",
                                          param="prompt", code="invalid_text")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})",
                                      param="prompt")
        return list(prompt)

    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None,
                max_tokens_must_fit: bool = False, add_special_tokens: bool = True,
                priority: int = 0) -> PreparedRequest:
        """max_tokens_must_fit: refuse a max_tokens the context cannot hold (the
        OpenAI API's rule) instead of stopping at the context window (LLM's).
        add_special_tokens: a text prompt gets BOS (etc.) where the model wants it."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", param="params")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if priority and not self.by_priority:
            raise InvalidRequestError("priority needs the priority scheduling policy (--scheduling-policy "
                                      "priority)", param="priority")
        # a copy, validated again: the caller may have changed its object since it
        # was built, and the engine must not see later changes either
        params = dataclasses.replace(params) if params is not None else SamplingParams(**self.defaults)
        ids = self.tokenize(prompt, add_special_tokens)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        keep = params.truncate_prompt_tokens
        if keep is not None:  # vLLM's: the prompt's last tokens (-1: as many as are accepted)
            if keep > self.max_prompt_tokens:
                raise InvalidRequestError(f"truncate_prompt_tokens must be at most {self.max_prompt_tokens} "
                                          "(the prompt tokens accepted), or -1", param="truncate_prompt_tokens")
            ids = ids[-(self.max_prompt_tokens if keep == -1 else keep):]
        n = len(ids)
        if n > self.max_prompt_tokens:
            window = (f"the context window is {self.max_model_len} tokens (prompt plus at least one "
                      "generated token must fit)") if self.max_prompt_tokens == self.max_model_len - 1 \
                else "a limit of this server"
            raise InvalidRequestError(f"the prompt has {n} tokens; at most {self.max_prompt_tokens} "
                                      f"are accepted ({window})", param="prompt", code="prompt_too_long")
        max_tokens = params.max_tokens
        if max_tokens is not None and max_tokens > self.max_tokens_limit:
            raise InvalidRequestError(f"max_tokens must be at most {self.max_tokens_limit}, got {max_tokens}",
                                      param="max_tokens")
        room = self.max_model_len - n
        if max_tokens is None:
            params = dataclasses.replace(params, max_tokens=min(room, self.max_tokens_limit))
        elif max_tokens > room and max_tokens_must_fit:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        if not all(t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}",
                                      param="stop_token_ids")
        if not all(t < self.vocab_size for t in params.logit_bias or ()):
            raise InvalidRequestError(f"logit_bias token ids must be below the vocabulary size {self.vocab_size}",
                                      param="logit_bias")
        if not all(t < self.vocab_size for t in params.allowed_token_ids or ()):
            raise InvalidRequestError(f"allowed_token_ids must be below the vocabulary size {self.vocab_size}",
                                      param="allowed_token_ids")
        bad_words = self.bad_words_ids(params.bad_words or ())
        grammar = None
        if params.structured_outputs is not None:  # last: the other checks are cheap
            if self.grammars is None:
                raise InvalidRequestError("structured outputs are not available", param="structured_outputs")
            grammar = self.grammars.compile(params.structured_outputs)
        return PreparedRequest(ids, params, grammar, bad_words, priority)

    def bad_words_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token run as vLLM tokenizes it: the word as written
        (left-stripped), and with a space before it when that spells the word
        as another first token in as many tokens (the word inside a text)."""
        runs: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for run in (plain, spaced) if spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
                if run not in runs:
                    runs.append(run)
        return tuple(runs)
