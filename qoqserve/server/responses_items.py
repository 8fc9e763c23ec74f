"""Responses output items and the Responses event stream, from the chat
path's choices and deltas (server/responses_api.py runs them): with
--reasoning-parser the reasoning as one `reasoning` item first, the text as
one `message` item, each tool call as a `function_call` item."""
from __future__ import annotations

import uuid


def output_items(choice: dict) -> list[dict]:
    """A finished chat choice ({"message", "logprobs"}) as output items."""
    message = choice["message"]
    output = [reasoning_item(message["reasoning"], "completed")] if message.get("reasoning") else []
    if message.get("content") or not message.get("tool_calls"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        output.append(message_item(message.get("content") or "", logprobs, "completed"))
    return output + [call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                     for c in message.get("tool_calls") or []]


def turn(output: list[dict]) -> dict:
    """Output items as the assistant's chat turn (what previous_response_id continues)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def message_item(text: str, logprobs: list | None, status: str, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "status": status,
            "role": "assistant", "content": [part] if status == "completed" or text else []}


def reasoning_item(text: str, status: str) -> dict:
    return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


class EventWriter:
    """Chat deltas -> Responses events: an open message item takes text; a
    tool call's first delta opens a function_call item (ending what was
    open), the rest are its arguments. With tools, white space around text
    is held back and dropped at an item's ends, as the whole response's
    message text is stripped (server/formats.py)."""

    def __init__(self, run, trim: bool):
        self.run, self.trim = run, trim
        self.items: list[dict] = []     # every item opened so far, as it stands
        self.thought: dict | None = None  # the open reasoning item
        self.text: dict | None = None   # the open message item
        self.call: dict | None = None   # the open function_call item
        self.held = ""                  # white space not sent yet

    def delta(self, choice: dict) -> list[str]:
        ev, d = [], choice["delta"]
        if d.get("reasoning"):  # the reasoning comes before any text or call
            if self.thought is None:
                self.thought = reasoning_item("", "in_progress")
                ev += self._added(self.thought)
            self.thought["content"][0]["text"] += d["reasoning"]
            ev.append(self._at(self.thought, "response.reasoning_text.delta", delta=d["reasoning"]))
        content = d.get("content") or ""
        if self.trim:
            content, self.held = self.held + content, ""
            body = content.rstrip()
            content, self.held = body if self.text is not None else body.lstrip(), content[len(body):]
        if content:
            if self.text is None:
                ev += self._close_thought() + self._close_call()
                self.text = message_item("", None, "in_progress")
                ev += self._added(self.text)
                ev.append(self._at(self.text, "response.content_part.added",
                                   part={"type": "output_text", "text": "", "annotations": []}))
                self.text["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            self.text["content"][0]["text"] += content
            lp = (choice.get("logprobs") or {}).get("content") or []
            ev.append(self._at(self.text, "response.output_text.delta", delta=content, logprobs=lp))
        for call in d.get("tool_calls") or []:
            if call.get("id") is not None:
                ev += self._close_thought() + self._close_text() + self._close_call()
                self.held = ""
                self.call = call_item(call["id"], call["function"]["name"], "", "in_progress")
                ev += self._added(self.call)
            args = call["function"]["arguments"]
            if args and self.call is not None:
                self.call["arguments"] += args
                ev.append(self._at(self.call, "response.function_call_arguments.delta", delta=args))
        return ev

    def close_all(self) -> list[str]:
        return self._close_thought() + self._close_text() + self._close_call()

    def _added(self, item: dict) -> list[str]:
        self.items.append(item)
        return [self.run.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _at(self, item: dict, kind: str, **fields) -> str:
        extra = {"content_index": 0} if item["type"] in ("message", "reasoning") else {}
        return self.run.event(kind, item_id=item["id"], output_index=self.items.index(item), **extra, **fields)

    def _done(self, item: dict) -> str:
        item["status"] = "completed"
        return self.run.event("response.output_item.done", output_index=self.items.index(item), item=item)

    def _close_text(self) -> list[str]:
        item, self.text = self.text, None
        if item is None:
            return []
        part = item["content"][0]
        return [self._at(item, "response.output_text.done", text=part["text"], logprobs=[]),
                self._at(item, "response.content_part.done", part=part), self._done(item)]

    def _close_thought(self) -> list[str]:
        item, self.thought = self.thought, None
        if item is None:
            return []
        return [self._at(item, "response.reasoning_text.done", text=item["content"][0]["text"]), self._done(item)]

    def _close_call(self) -> list[str]:
        item, self.call = self.call, None
        if item is None:
            return []
        return [self._at(item, "response.function_call_arguments.done", arguments=item["arguments"]),
                self._done(item)]
