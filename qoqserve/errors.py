"""The error types callers are meant to catch, at the bottom of the package so
every layer can raise them (the server maps them to OpenAI-style errors)."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint (directory or file) cannot be used.

    Subclasses ValueError so callers that validate user input can catch both
    this and UnsupportedModelError with one clause. The message always names
    the offending file, because "truncated file" alone is useless when a
    sharded checkpoint has dozens of them.
    """


class InvalidRequestError(ValueError):
    """A request the engine refuses at admission: its own fault, nobody else's.
    `param` names the offending field (OpenAI's error.param), when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ConstraintDeadEndError(InvalidRequestError):
    """Constrained requests whose grammar allows no token of the vocabulary
    next (e.g. a choice holding bytes the tokenizer has no token for): found
    while sampling, their own fault; the step goes on without them."""

    def __init__(self, request_ids: list[str],
                 message: str = "the output constraint cannot be continued: no token of this model's "
                                "vocabulary produces what it requires next (text the tokenizer cannot spell?)",
                 param: str | None = "structured_outputs", code: str = "constraint_dead_end"):
        super().__init__(message, param=param, code=code)
        self.request_ids = list(request_ids)


class BannedEverythingError(ConstraintDeadEndError):
    """Requests left with no token to pick once their banned tokens are out
    (layers/token_bans.py): what allowed_token_ids or a grammar allows, all
    banned by bad_words or as stop tokens before min_tokens are out."""

    def __init__(self, request_ids: list[str]):
        super().__init__(request_ids, "no token is left to pick at this step: what allowed_token_ids (or the "
                         "output constraint) allows is all banned, by bad_words or as tokens that would end "
                         "the output before min_tokens", param=None, code="no_token_allowed")


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its bound (--max-waiting-queue-length):
    the request was not queued. Not the request's fault; retrying later may
    succeed, after about `retry_after_s` (the server sends it as Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died, or a collective of a step failed or timed
    out: the ranks no longer agree on what they computed, so the engine stops
    (every later call fails at once; the server answers 503)."""
