"""Engine outputs -> OpenAI JSON, for /v1/completions and /v1/chat/completions.

One formatter per choice (an engine request); it remembers what a stream
has already sent (the chat role, the completion text offset). The choices of
one response share its id and creation time (server/choices.py joins them).
"""
from __future__ import annotations

import time

from qoqserve.engine.output import RequestOutput
from qoqserve.model_loader.tokenizer import Tokenizer
from qoqserve.server.reasoning import ReasoningSplitter
from qoqserve.server.tools import ToolCallParser

# JSON has no -inf: a token a constraint rules out (in a top list longer than
# what the grammar allows) gets vLLM's floor instead
LOGPROB_FLOOR = -9999.0


def _finite(lp: float | None) -> float | None:
    return None if lp is None else max(lp, LOGPROB_FLOOR)


def ranked_prompt_logprobs(tokenizer: Tokenizer, ids: list[int], chosen: list[float],
                           tops: list[list[tuple[int, float]]] | None, ranks: list[int]) -> list:
    """vLLM's prompt_logprobs: per prompt token (the first: null) its own and the
    top N {token id: {logprob, rank, decoded_token}} at its position."""
    def entry(t: int, lp: float, rank: int) -> tuple[str, dict]:
        return str(t), {"logprob": _finite(lp), "rank": rank, "decoded_token": tokenizer.token_to_str(t)}

    return [None] + [dict([*(entry(t, lp, j + 1) for j, (t, lp) in enumerate(top or [])), entry(tok, lp, rank)])
                     for tok, lp, rank, top in zip(ids[1:], chosen, ranks, tops or [None] * len(chosen))]


def _new_token_logprobs(out: RequestOutput, everything: bool):
    """(token ids, logprobs, top lists) of this output's new tokens, or of all of them."""
    if out.logprobs is None:
        return None
    ids = out.token_ids if everything else out.token_ids[len(out.token_ids) - len(out.delta_token_ids):]
    n = len(ids)
    lps = out.logprobs[len(out.logprobs) - n:]
    tops = out.top_logprobs[len(out.top_logprobs) - n:] if out.top_logprobs else [[] for _ in ids]
    return ids, lps, tops


class Format:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, num_prompt_tokens: int,
                 index: int = 0, created: int | None = None, ranked_prompt: list | None = None,
                 tokens_as_ids: bool = False):
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.index = index  # of this choice in the response
        self.created = int(time.time()) if created is None else created
        self.ranked_prompt = ranked_prompt  # vLLM's prompt_logprobs, when asked for
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids

    def token_name(self, t: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N"."""
        return f"token_id:{t}" if self.tokens_as_ids else self.tokenizer.token_to_str(t)

    def response_fields(self) -> dict:
        """What the whole response carries beside its choices."""
        return {}

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, out: RequestOutput) -> dict | None:
        choice = self.delta_choice(out)
        return None if choice is None else self.envelope(self.chunk_object_name, [choice])

    def choice(self, out: RequestOutput) -> dict:
        raise NotImplementedError

    def delta_choice(self, out: RequestOutput) -> dict | None:
        raise NotImplementedError


class CompletionFormat(Format):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, echo_text: str = "", prompt_logprobs: tuple | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo_text = echo_text
        # (ids, logprobs, tops) of the echoed prompt; its first token has none (null, as OpenAI)
        self.prompt_logprobs = prompt_logprobs
        self.offset = 0  # characters of text sent so far (for text_offset)

    def _logprobs(self, entries, start: int) -> dict | None:
        if entries is None:
            return None
        ids, lps, tops = entries
        offsets = []
        for t in ids:  # in the text, whatever the tokens are named
            offsets.append(start)
            start += len(self.tokenizer.token_to_str(t))
        return {"tokens": [self.token_name(t) for t in ids], "token_logprobs": [_finite(lp) for lp in lps],
                "text_offset": offsets,
                "top_logprobs": [None if top is None else {self.token_name(t): _finite(lp) for t, lp in top}
                                 for top in tops]}

    def _after_prompt(self, lp: dict | None) -> dict | None:
        """The echoed prompt's entries, then the output's."""
        if self.prompt_logprobs is None:
            return lp
        prompt = self._logprobs(self.prompt_logprobs, 0)
        return prompt if lp is None else {k: prompt[k] + lp[k] for k in prompt}

    def choice(self, out: RequestOutput) -> dict:
        lp = self._logprobs(_new_token_logprobs(out, True), len(self.echo_text))
        choice = {"index": self.index, "text": self.echo_text + out.text, "logprobs": self._after_prompt(lp),
                  "finish_reason": out.finish_reason}
        if self.ranked_prompt is not None:  # vLLM puts it on each completion choice
            choice["prompt_logprobs"] = self.ranked_prompt
        return choice

    def delta_choice(self, out: RequestOutput) -> dict | None:
        text, echo = out.delta_text, self.echo_text
        if echo:
            text, self.echo_text = echo + text, ""
        if not text and not out.finished and not out.delta_token_ids:
            return None
        lp = self._logprobs(_new_token_logprobs(out, False), self.offset + len(echo))
        if echo:
            lp = self._after_prompt(lp)
        self.offset += len(text)
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}


class ChatFormat(Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tool_parser: ToolCallParser | None = None,
                 reasoning: ReasoningSplitter | None = None, include_reasoning: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent_role = False
        self.tool_parser = tool_parser  # the request has tools: its text may hold tool calls
        # --reasoning-parser: the text's reasoning apart (and tool calls read only in the answer)
        self.reasoning, self.include_reasoning = reasoning, include_reasoning

    def _logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        ids, lps, tops = entries

        def entry(t: int, lp: float) -> dict:
            s = self.token_name(t)
            return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, lp, top in zip(ids, lps, tops)]}

    def response_fields(self) -> dict:
        # vLLM puts it on the chat response, beside the choices
        return {} if self.ranked_prompt is None else {"prompt_logprobs": self.ranked_prompt}

    def _finish_reason(self, out: RequestOutput) -> str | None:
        # OpenAI's: a turn that ends in tool calls ends with "tool_calls"
        if out.finish_reason == "stop" and self.tool_parser is not None and self.tool_parser.calls:
            return "tool_calls"
        return out.finish_reason

    def choice(self, out: RequestOutput) -> dict:
        message = {"role": "assistant", "content": out.text}
        if self.reasoning is not None:
            reasoning, message["content"] = self.reasoning.feed(out.text, final=True)
            message["content"] = message["content"] or None
            if self.include_reasoning:
                message["reasoning"] = reasoning or None
        if self.tool_parser is not None:
            content, _ = self.tool_parser.feed(message["content"] or "", final=True)
            message["content"] = content.strip() or None
            if self.tool_parser.calls:
                message["tool_calls"] = self.tool_parser.tool_calls()
        return {"index": self.index, "message": message,
                "logprobs": self._logprobs(_new_token_logprobs(out, True)),
                "finish_reason": self._finish_reason(out)}

    def delta_choice(self, out: RequestOutput) -> dict | None:
        delta: dict = {}
        if not self.sent_role:
            delta["role"] = "assistant"
            self.sent_role = True
        text, calls = out.delta_text, []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final=out.finished)
            if reasoning and self.include_reasoning:
                delta["reasoning"] = reasoning
        if self.tool_parser is not None:
            text, calls = self.tool_parser.feed(text, final=out.finished)
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [c.to_dict() for c in calls]
        if not delta and not out.finished and not out.delta_token_ids:
            return None
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs(_new_token_logprobs(out, False)),
                "finish_reason": self._finish_reason(out)}
