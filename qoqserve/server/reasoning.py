"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's text
split into its reasoning, between `<think>` and `</think>`, and its answer,
for the chat message's `reasoning` and `content` fields.

One splitter serves the parsers vLLM names for these tags (`deepseek_r1`,
`qwen3`): where the reasoning starts is read from the prompt instead of from
the parser's name. A prompt whose template left a `<think>` open
(DeepSeek-R1, Qwen3's thinking-only models) starts the output inside the
reasoning; otherwise a `<think>` at the very start of the output opens it
(Qwen3's hybrid models; with enable_thinking false their template closes the
tags in the prompt, so the whole output is the answer), and text without it
is all answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from qoqserve.engine.structured import choice_grammar
from qoqserve.sampling_params import StructuredOutputs
from qoqserve.server.tools import take_until

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
_BLANK = {"type": "regex", "pattern": "[ \\n]{0,4}"}  # between </think> and the answer


def after_reasoning(spec: StructuredOutputs, opened: bool) -> StructuredOutputs:
    """The constraint moved past the reasoning, as vLLM applies it: the
    reasoning is free text up to `</think>` (opened: the prompt began it;
    else the output may open one or answer at once), then the spec. A
    structural tag of the older trigger form cannot be composed: unchanged."""
    kind, value = spec.kind, getattr(spec, spec.kind)
    if kind == "structural_tag":
        tag = json.loads(value)
        if "format" not in tag:
            return spec
        answer = tag["format"]
    elif kind in ("json", "json_object"):
        answer = {"type": "json_schema", "json_schema": json.loads(value) if kind == "json" else {"type": "object"}}
    elif kind == "regex":
        answer = {"type": "regex", "pattern": value}
    else:
        answer = {"type": "grammar", "grammar": choice_grammar(value) if kind == "choice" else value}
    think = {"type": "tag", "begin": "" if opened else START, "content": {"type": "any_text"}, "end": END}
    fmt: dict = {"type": "sequence", "elements": [think, _BLANK, answer]}
    if not opened:
        fmt = {"type": "or", "elements": [fmt, answer]}
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": fmt})


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt (its last few tokens as text) ends inside a <think>."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


@dataclass
class ReasoningSplitter:
    """Fed the output text piece by piece (or whole, with final), returns
    each piece's (reasoning, content). Text that may be the start of a tag is
    held back until it is known; the tags themselves are never returned, nor
    the whitespace between `</think>` and the answer."""
    in_reasoning: bool = False  # the prompt left a <think> open
    _state: str = "start"       # until the output's start is known; then reasoning | lead | content
    _buf: str = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while True:
            if self._state == "start":  # a <think> may open the output (again), after whitespace
                head = self._buf.lstrip()
                if head.startswith(START):
                    self._buf, self._state = head[len(START):], "reasoning"
                elif START.startswith(head) and not final:
                    return reasoning, content  # too little to tell
                else:
                    self._state = "reasoning" if self.in_reasoning else "content"
            elif self._state == "reasoning":
                before, self._buf, found = take_until(self._buf, END, final)
                reasoning += before
                if not found:
                    return reasoning, content
                self._state = "lead"
            elif self._state == "lead":  # the blank lines a template puts before the answer
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self._state = "content"
            else:
                content += self._buf
                self._buf = ""
                return reasoning, content
