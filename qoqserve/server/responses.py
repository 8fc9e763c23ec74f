"""The response bodies, as schemas for /openapi.json and /docs.

formats.py builds the bodies as plain dicts (fast on every chunk); these
models only describe them, and tests/test_server_edges.py checks real
responses against them, so the documentation cannot quietly go stale.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "rate_limit_error, server_error or service_unavailable")
    param: str | None = Field(description="the offending field, as a dotted path")
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: list[dict[str, float]]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's prompt_logprobs, by token id


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="on the full response; in a stream only with "
                                                  "stream_options.include_usage, on the last chunk")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text matching the function's parameters")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the turn is only tool calls")
    tool_calls: list[ToolCall] | None = Field(None, description="with tools: the calls the model made")
    reasoning: str | None = Field(None, description="with --reasoning-parser: the text between <think> and "
                                                    "</think> (null: none)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "degraded"] = Field(
        description="degraded: a step failed that could not be put on one request (its requests "
                    "failed; the server goes on serving)")
    request_faults: int = Field(description="requests ended because a step failed on them alone")
    engine_faults: int = Field(description="step failures no single request explained")
    last_engine_fault: str | None
    num_running: int
    num_waiting: int = Field(description="admitted requests without a first token yet")
    max_waiting: int | None = Field(description="--max-waiting-queue-length (null: unbounded)")
    num_refused: int = Field(description="requests refused with a 429 because the queue was full")
    kv_free_blocks: int
    kv_total_blocks: int
    rss_bytes: int | None = Field(description="the server's resident memory (Linux)")
    gc_frozen_objects: int = Field(description="objects of the start-up heap that Python's collector "
                                   "no longer walks (`serve` freezes them before serving)")


STREAM = "`stream: true`: `text/event-stream`, one chunk per step, then `data: [DONE]`"
ERRORS = {
    "4XX": {"model": ErrorResponse, "description": "the request's fault: 400 bad field, 401 key, "
            "404 model, 405 method, 413 body too large, 429 waiting queue full (with Retry-After)"},
    "5XX": {"model": ErrorResponse, "description": "500 the request failed in the engine "
            "(server_error); 503 the engine is not running"},
}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
