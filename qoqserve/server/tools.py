"""Tool calls on /v1/chat/completions, in the Hermes format (Qwen2.5, Hermes,
SmolLM3 and other templates that speak it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders `tools` and knows `<tool_call>` gets the tools and
the conversation as is; any other template (the embedded SmolLM2's has no
tool format) gets them described in the system message, in the same format,
with earlier calls and tool results written out as text. Unless tool_choice
is "none", the output is constrained by an xgrammar structural tag: inside
a `<tool_call>` the arguments must match the function's parameter schema;
"auto" leaves the rest free, "required" allows only calls (at least one)
and a named function exactly one call of it.
ToolCallParser turns the text back into OpenAI tool_calls, streaming or not.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

BEGIN, END = "<tool_call>", "</tool_call>"
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_WRAPPER_END = "}\n" + END

_SYSTEM = """You are a function calling AI model. You may call one or more functions to assist \
with the user query. The functions are listed in <tools></tools> XML tags:
<tools>
{tools}
</tools>
For each function call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_speaks_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template and BEGIN in chat_template


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    args = _parsed(fn.get("arguments", "{}"))
    return f'{BEGIN}\n{json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)}\n{END}'


def template_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """The conversation as the chat template gets it. messages: role, content
    (text) and, where given, tool_calls / tool_call_id / name. native: the
    template renders tools itself (template_speaks_tools)."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # HF templates want the arguments as a mapping
                m["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": _parsed(
                    c.get("function", {}).get("arguments"))}} for c in m["tool_calls"]]
            out.append(m)
        return out
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in m["tool_calls"]])
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        desc = _SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + desc}
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out


def _parsed(args):
    """A call's arguments as a mapping, when they are JSON text (else as sent)."""
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _call_tag(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "tag", "begin": f'{BEGIN}\n{{"name": {json.dumps(function["name"], ensure_ascii=False)}, '
                                     '"arguments": ',
            "content": {"type": "json_schema", "json_schema": params}, "end": _WRAPPER_END}


def tool_structural_tag(functions: list[dict], choice: str | dict, parallel: bool) -> dict:
    """The xgrammar structural tag constraining the output for tool_choice
    "auto" (text, with calls where the model starts one), "required" (only
    calls, at least one) or a named function ({"type": "function",
    "function": {"name"}}: exactly one call of it)."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fmt = _call_tag(next(f for f in functions if f["name"] == name))
    elif choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [_call_tag(f) for f in functions], "separator": "\n",
               "at_least_one": True, "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": [_call_tag(f) for f in functions],
               "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None       # with the name, on a call's first delta
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d.update(id=self.id, type="function")
            d["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            d["function"] = {"arguments": self.arguments}
        return d


@dataclass
class ToolCallParser:
    """Hermes-format text -> content text and tool-call deltas, fed piece by
    piece as a stream arrives (or the whole text at once). Text that may be
    the start of a `<tool_call>` or of a call's closing `}` + `</tool_call>`
    is held back until it is known."""
    _buf: str = ""
    _state: str = "text"            # text | head (before the arguments) | args
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, deltas = "", []
        while True:
            if self._state == "text":
                before, self._buf, found = take_until(self._buf, BEGIN, final)
                content += before
                if not found:
                    return content, deltas
                self._state = "head"
            elif self._state == "head":
                m = _CALL_HEAD.match(self._buf)
                if m is not None and m.end() == len(self._buf) and not final:
                    m = None  # more whitespace may follow: the arguments start after it
                if m is None:
                    if final:  # a broken call: keep it as text
                        content += BEGIN + self._buf
                        self._buf = ""
                    return content, deltas
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": json.loads(f'"{m.group(1)}"'),
                        "arguments": ""}
                self.calls.append(call)
                deltas.append(ToolCallDelta(len(self.calls) - 1, call["id"], call["name"]))
                self._buf, self._state = self._buf[m.end():], "args"
            else:
                i = self._buf.find(END)
                if i >= 0:
                    args, self._buf, self._state = self._buf[:i].rstrip(), self._buf[i + len(END):], "text"
                    args = args[:-1].rstrip() if args.endswith("}") else args  # the wrapper's brace
                elif final:
                    args, self._buf = self._buf, ""
                else:
                    cut = max(0, len(self._buf) - len(_WRAPPER_END) - 8)  # room for whitespace
                    args, self._buf = self._buf[:cut], self._buf[cut:]
                if args:
                    self.calls[-1]["arguments"] += args
                    deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=args))
                if i < 0:
                    return content, deltas

    def tool_calls(self) -> list[dict]:
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]


def take_until(buf: str, token: str, final: bool) -> tuple[str, str, bool]:
    """A stream's buffer at token: (the text before it, what follows it, True),
    or where it has not come, (what can go out now, what is held back: an end
    that may be its start, unless final, False)."""
    i = buf.find(token)
    if i >= 0:
        return buf[:i], buf[i + len(token):], True
    keep = 0 if final else _partial_suffix(buf, token)
    return buf[:len(buf) - keep], buf[len(buf) - keep:], False


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest end of text that starts token."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
