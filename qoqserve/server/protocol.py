"""OpenAI request schemas and error bodies.

These models are the endpoints' declared bodies, so /openapi.json and /docs
publish them. They are strict (a string is not a number, NaN is not a
number), publish the same ranges the engine's admission enforces (taken
from qoqserve.sampling_params, so the two cannot drift), refuse text that is
not valid Unicode, and ignore fields they do not know, as vLLM does, so
newer clients keep working.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from qoqserve.sampling_params import FLOAT_RANGES, MAX_TOP_LOGPROBS, SEED_RANGE, is_valid_text


class APIError(Exception):
    """An error the client caused (or must be told about), as OpenAI shapes it."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _ErrorJSON(JSONResponse):
    def render(self, content) -> bytes:
        # ASCII escapes: an error may quote client text, and must never fail to encode
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(e: APIError) -> JSONResponse:
    return _ErrorJSON(e.body(), status_code=e.status, headers=e.headers)


_BRANCH_TAGS = {"str", "int", "float", "bool"}


def _field_path(loc: tuple) -> str:
    """The dotted path of a pydantic loc, without the tags it adds for union
    branches ("list[int]", "function-after[...]")."""
    return ".".join(str(p) for p in loc
                    if not (isinstance(p, str) and ("[" in p or p in _BRANCH_TAGS)))


def from_validation_errors(errors: list[dict], prefix: tuple = ()) -> APIError:
    """Pydantic's errors as one 400 naming the field; `prefix` is the part of
    each loc to drop (FastAPI puts "body" first). A union reports every
    branch: the one that had the right type and failed on its value says
    what is wrong; "not a string" from another branch would not."""
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    path = _field_path(err["loc"][len(prefix):])
    kind = err["type"]
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err["msg"])
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    if not path and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
    return APIError(400, f"{path or 'body'}: {err['msg']}", param=path or None,
                    code="invalid_type" if kind.endswith("_type") else kind)


def _valid_text(s: str) -> str:
    if not is_valid_text(s):
        raise PydanticCustomError("invalid_text", "not valid Unicode text (it holds a lone surrogate)")
    return s


Text = Annotated[str, AfterValidator(_valid_text)]


def _float(name: str, doc: str):
    lo, hi, open_lo = FLOAT_RANGES[name]
    bound = {"gt": lo} if open_lo else {"ge": lo}
    return Field(None, le=hi, description=doc, **bound)


class StrictRequest(BaseModel):
    """Every request body's base: strict types, unknown fields ignored, no NaN."""
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictRequest):
    include_usage: bool = Field(False, description="end the stream with a chunk holding `usage`")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk "
                                                            "also holds the usage so far")


class StructuredOutputsField(StrictRequest):
    """vLLM's `structured_outputs` (exactly one of json, regex, choice, grammar,
    json_object, structural_tag)."""
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | bool | Text | None = Field(None, alias="json", description="a JSON schema")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = Field(None, description="EBNF (GBNF-style, as xgrammar reads it)")
    json_object: bool | None = None
    structural_tag: dict[str, Any] | Text | None = Field(None, description="an xgrammar structural tag")
    disable_any_whitespace: bool = False


class JSONSchemaSpec(StrictRequest):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: Text = Field(description="required by OpenAI; not used")
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = Field(None, description='with type "json_schema"')


class SamplingFields(StrictRequest):
    """Fields both endpoints share (OpenAI's plus vLLM's extensions)."""
    model: Text | None = Field(None, description="the served model's id (GET /v1/models); optional")
    temperature: float | None = _float("temperature", "0 is greedy; default 1")
    top_p: float | None = _float("top_p", "nucleus sampling mass; default 1")
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables")
    min_p: float | None = _float("min_p", "drop tokens below min_p of the top token's probability; default 0")
    n: int = Field(1, ge=1, le=128, description="choices per prompt (each sampled apart; seeded: seed + i)")
    stream: bool = Field(False, description="server-sent events ending in `data: [DONE]`")
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = Field(None, description="strings that end the output (not included)")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1],
                             description="a 64-bit seed: the same seed gives the same tokens")
    presence_penalty: float | None = _float("presence_penalty", "OpenAI presence penalty")
    frequency_penalty: float | None = _float("frequency_penalty", "OpenAI frequency penalty")
    repetition_penalty: float | None = _float("repetition_penalty", "HF-style; 1 disables")
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = Field(True, description="vLLM's: false writes special tokens out in the text")
    return_tokens_as_token_ids: bool = Field(False, description=(
        'vLLM\'s: logprobs name each token "token_id:N" (for tokens that are not text on their own)'))
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "vLLM's: each prompt token's logprob and rank and the N most likely at its position (not with stream)"))
    logit_bias: dict[Text, float] | None = Field(
        None, description='{"token id": bias in [-100, 100]}, added to the logits before sampling')
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="vLLM's: only these tokens may be picked")
    bad_words: list[Text] | None = Field(None, description="vLLM's: words the output must not hold")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM's: keep only the prompt's last k tokens (-1: as many as fit)")
    priority: int = Field(0, description="vLLM's: with --scheduling-policy priority, lower runs first")
    user: Text | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="vLLM's constraint on the output (docs/server.md)")
    # vLLM's fields before 0.12 (still sent by older clients)
    guided_json: dict[str, Any] | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias ({"token id": bias}, OpenAI's ids as strings) with int keys."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)",
                           param="logit_bias") from None


class CompletionRequest(SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]] = Field(
        description="text, token ids, or a list of either (a choice per prompt and n)")
    max_tokens: int | None = Field(16, ge=0, description="null: the rest of the context window; 0 only with echo")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="also return this many most likely tokens per step")
    echo: bool = Field(False, description="the prompt before the output; with logprobs, its tokens' logprobs too")
    add_special_tokens: bool = Field(True, description="vLLM's: BOS (etc.) where the model wants one")
    best_of: int | None = Field(None, description="must be 1")
    suffix: Text | None = Field(None, description="not supported: refused when set")


class TextPart(StrictRequest):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # declared before content: content's check reads it
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="an assistant turn's tool calls (lets it have no content)")
    content: Text | list[TextPart] | None = Field(
        None, validate_default=True,
        description="required, except on an assistant message with tool_calls")
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, v, info: ValidationInfo):
        # OpenAI's rule: only an assistant turn that made tool calls may say nothing
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError(
                "content_required", "content must not be null (only an assistant message with "
                "tool_calls may omit it)")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(StrictRequest):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema; default: no arguments")
    strict: bool | None = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDef


def function_dicts(tools: list[Tool] | None) -> list[dict]:
    """The functions of a request's tools, as the chat template and the grammar take them."""
    return [t.function.model_dump(exclude_none=True) for t in tools or []]


class ToolChoiceFunction(StrictRequest):
    name: Text


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatTemplateFields(StrictRequest):
    """How a conversation becomes the prompt (vLLM's fields), in /v1/chat/completions and /tokenize."""
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="continue the last message instead of opening a "
                                                            "new turn; needs add_generation_prompt false")
    chat_template: Text | None = Field(None, description="a Jinja template in place of the model's (the "
                                                         "server must trust request templates)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the template")
    add_special_tokens: bool = Field(False, description="BOS (etc.) on the rendered text: the template "
                                                        "already carries them")


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(description="the conversation, oldest first; not empty")
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs")
    include_reasoning: bool = Field(True, description="vLLM's: with --reasoning-parser, false leaves the "
                                                      "reasoning out of the answer")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default "auto" with tools, else "none"')
    parallel_tool_calls: bool = True
