"""OpenAI's Responses API request (POST /v1/responses), and what it asks
for as a chat completion: the server runs a response through the chat path
(chat template, tools, structured outputs, sampling) and writes the result
as a response (server/responses_api.py).

Taken: `input` as text or a list of items (messages with text content, the
model's earlier `function_call`s and their `function_call_output`s),
`instructions` (a system message first), `max_output_tokens`, `temperature`,
`top_p`, `tools` (functions), `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema), `top_logprobs`, `stream`,
`store` and `previous_response_id`, `metadata`; vLLM's sampling extensions
as on chat completions; an earlier response's `reasoning` items (as clients
send `output` back) become the next assistant turn's `reasoning_content`.
Anything else of the item kinds (images, files, built-in tools) is refused
with a 400 naming it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from qoqserve.sampling_params import MAX_TOP_LOGPROBS
from qoqserve.server.protocol import APIError, SamplingFields, StrictRequest, Text


class InputText(StrictRequest):
    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictRequest):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field(description="the call's arguments, JSON text")


class FunctionCallOutputItem(StrictRequest):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text


class ReasoningText(StrictRequest):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(StrictRequest):
    """An earlier response's reasoning, sent back as clients replay `output`:
    kept as the next assistant turn's `reasoning_content` (what thinking
    models' templates read), else dropped."""
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


_KINDS = ("function_call", "function_call_output", "reasoning")


def _item_kind(item) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    return f"item[{kind if kind in _KINDS else 'message'}]"


# one list, four shapes, told apart by `type` (the tags hold "[": error paths drop them)
InputItem = Annotated[Annotated[MessageItem, Tag("item[message]")]
                      | Annotated[FunctionCallItem, Tag("item[function_call]")]
                      | Annotated[FunctionCallOutputItem, Tag("item[function_call_output]")]
                      | Annotated[ReasoningItem, Tag("item[reasoning]")], Discriminator(_item_kind)]


class FunctionTool(StrictRequest):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictRequest):
    type: Literal["function"]
    name: Text


class TextFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(StrictRequest):
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    input: Text | list[InputItem] = Field(description="text, or a list of messages and function call items")
    instructions: Text | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    store: bool = Field(True, description="keep the response for previous_response_id and GET (in memory)")
    background: bool = Field(False, description="answer at once and run on (needs store; GET follows it)")
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None

    def chat_fields(self, history: list[dict]) -> dict[str, Any]:
        """The chat completion this response runs as (a body for
        ChatCompletionRequest); history: the earlier turns that
        previous_response_id brings, as chat messages."""
        if self.n != 1:
            raise APIError(400, "n must be 1 on /v1/responses", param="n")
        body = self.model_dump(exclude_unset=True, exclude={
            "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "top_logprobs",
            "store", "background", "previous_response_id", "metadata", "n", "stream_options"}, by_alias=True)
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += history + input_messages(self.input)
        body.update(messages=messages, parallel_tool_calls=self.parallel_tool_calls,
                    max_completion_tokens=self.max_output_tokens)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str)
                                   else {"type": "function", "function": {"name": self.tool_choice.name}})
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
                raise APIError(400, "a json_schema format needs a name and a schema", param="text.format")
            body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                       {"type": "json_schema", "json_schema": {"name": fmt.name,
                                                                                "schema": fmt.schema_}})
        if self.top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body


def input_messages(items: str | list) -> list[dict]:
    """Responses input as chat messages: a run of function_call items is one
    assistant turn with tool_calls, each function_call_output a tool turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thought = None  # a reasoning item's text, for the assistant turn after it
    for item in items:
        if isinstance(item, ReasoningItem):
            thought = item.text()
            continue
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if out[-1]["role"] == "assistant" and thought is not None:
            out[-1]["reasoning_content"] = thought
        thought = None
    if not out:
        raise APIError(400, "input must not be empty", param="input")
    return out
