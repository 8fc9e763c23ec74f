"""--reasoning-parser (server/reasoning.py): a thinking model's <think> ...
</think> apart from its answer, whole and streamed, in chat messages, with
tool calls and with structured outputs, and as Responses reasoning items."""
import json
import random

import httpx
import pytest
from conftest import in_process_server

from qoqserve.engine.output import RequestOutput
from qoqserve.server.config import ServerConfig
from qoqserve.server.formats import ChatFormat
from qoqserve.server.reasoning import ReasoningSplitter, after_reasoning, opens_reasoning
from qoqserve.server.tools import ToolCallParser

# (the prompt left a <think> open, output) -> (reasoning, content)
CASES = [
    (True, "Let me see.\n</think>\n\nParis.", ("Let me see.\n", "Paris.")),
    (True, "<think>twice</think>Paris", ("twice", "Paris")),         # DeepSeek-R1-0528 writes the tag again
    (True, "cut short by max_tokens", ("cut short by max_tokens", "")),
    (False, "<think>\nhm</think>\n\nParis.", ("\nhm", "Paris.")),      # Qwen3 thinking
    (False, "  <think>a</think> b", ("a", "b")),
    (False, "Paris.", ("", "Paris.")),                                 # no thinking: all answer
    (False, "<thi", ("", "<thi")),
    (False, "a <think> b </think> c", ("", "a <think> b </think> c")),  # a tag inside the answer is text
    (False, "<think>a</thin", ("a</thin", "")),
    (False, "", ("", "")),
]


@pytest.mark.parametrize("opened,text,want", CASES)
def test_whole_and_streamed_in_any_pieces_split_alike(opened, text, want):
    assert ReasoningSplitter(opened).feed(text, final=True) == want
    rng = random.Random(len(text))
    for _ in range(20):  # every way of cutting it into pieces gives the same parts
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s, r, c = ReasoningSplitter(opened), "", ""
        for i, p in enumerate(pieces):
            dr, dc = s.feed(p, final=i == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert (r, c) == want, pieces


def test_a_tag_is_held_back_until_it_is_known():
    s = ReasoningSplitter(True)
    assert s.feed("thinking </th") == ("thinking ", "")
    assert s.feed("ink>") == ("", "")
    assert s.feed("\n\n") == ("", "")  # the blank lines before the answer
    assert s.feed("Paris") == ("", "Paris")


def test_the_prompt_says_where_the_output_starts():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")           # thinking-only templates, R1
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not opens_reasoning("<|im_start|>assistant\n")


def _out(text, delta, finished, rid="r"):
    return RequestOutput(rid, [1], [1] * len(text), text, delta, [1] * len(delta), finished,
                         "stop" if finished else None)


def test_chat_messages_and_deltas_carry_the_reasoning_and_tool_calls_only_from_the_answer():
    text = 'Which tool?</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    fmt = ChatFormat("id", "m", None, 3, tool_parser=ToolCallParser(), reasoning=ReasoningSplitter(True))
    msg = fmt.choice(_out(text, text, True))["message"]
    assert msg["reasoning"] == "Which tool?" and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["f"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    fmt = ChatFormat("id", "m", None, 3, tool_parser=ToolCallParser(), reasoning=ReasoningSplitter(True))
    seen, deltas = "", []
    for i in range(0, len(text), 5):
        piece = text[i:i + 5]
        seen += piece
        d = fmt.delta_choice(_out(seen, piece, i + 5 >= len(text)))
        deltas.append(d["delta"] if d else {})
    assert "".join(d.get("reasoning", "") for d in deltas) == "Which tool?"
    assert not any(d.get("content") for d in deltas)
    assert "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])) == '{"x": 1}'
    quiet = ChatFormat("id", "m", None, 3, reasoning=ReasoningSplitter(True), include_reasoning=False)
    assert "reasoning" not in quiet.choice(_out("a</think>b", "a</think>b", True))["message"]


def test_the_constraint_moves_past_the_reasoning():
    from qoqserve.sampling_params import StructuredOutputs

    spec = StructuredOutputs(regex="[0-9]+")
    opened = json.loads(after_reasoning(spec, True).structural_tag)["format"]
    assert opened["elements"][0] == {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    assert opened["elements"][2] == {"type": "regex", "pattern": "[0-9]+"}
    either = json.loads(after_reasoning(spec, False).structural_tag)["format"]
    assert either["type"] == "or" and either["elements"][1] == {"type": "regex", "pattern": "[0-9]+"}
    old_style = StructuredOutputs(structural_tag={"structures": [], "triggers": []})
    assert after_reasoning(old_style, True) is old_style


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n<think>\n")
NOT_THINKING = THINKING + "\n</think>\n\n"


@pytest.fixture(scope="module")
def server(reference_llm):
    config = ServerConfig(reasoning_parser="qwen3", trust_request_chat_template=True)
    with in_process_server(reference_llm.engine, config) as (base, _):
        yield base


def _chat(base, **body):
    body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12, "temperature": 0,
            **body}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _streamed(base, **body):
    body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12, "temperature": 0,
            "stream": True, **body}
    reasoning = content = ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
    return reasoning or None, content or None


def test_a_served_prompt_that_opens_the_reasoning_streams_what_the_whole_answer_holds(server):
    msg = _chat(server, chat_template=THINKING)
    assert msg["reasoning"] and msg["content"] is None  # cut short by max_tokens while thinking
    assert _streamed(server, chat_template=THINKING) == (msg["reasoning"], msg["content"])
    plain = _chat(server, chat_template=NOT_THINKING)
    assert plain["reasoning"] is None and plain["content"]
    assert _streamed(server, chat_template=NOT_THINKING) == (None, plain["content"])


def test_the_answer_after_the_reasoning_keeps_the_schema(server):
    # the prompt closed an empty <think>: the model may open one (this one copies the
    # prompt's empty one) or answer at once; either way the answer is the schema's
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    msg = _chat(server, chat_template=NOT_THINKING, max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert isinstance(json.loads(msg["content"])["answer"], int), msg
    assert "<think>" not in msg["content"] and (msg["reasoning"] or "").strip() == ""


class _Run:
    def event(self, kind, **fields):
        return {"type": kind, **fields}


def test_responses_put_the_reasoning_in_its_own_item_first():
    from qoqserve.server.responses_items import EventWriter, output_items

    items = output_items({"message": {"content": "Paris.", "reasoning": "Let me see."}, "logprobs": None})
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert [i["type"] for i in output_items({"message": {"content": "Paris.", "reasoning": None}})] == ["message"]
    w = EventWriter(_Run(), trim=False)
    events = w.delta({"delta": {"reasoning": "Let me "}}) + w.delta({"delta": {"reasoning": "see."}})
    events += w.delta({"delta": {"content": "Paris."}}) + w.close_all()
    kinds = [e["type"] for e in events]
    assert kinds == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert events[3]["text"] == "Let me see." and events[3]["output_index"] == 0
    assert [i["type"] for i in w.items] == ["reasoning", "message"]


@pytest.mark.parametrize("opened", [True, False])
def test_tool_calls_and_every_constraint_kind_compose_after_the_reasoning(reference_llm, opened):
    import xgrammar as xgr

    from qoqserve.sampling_params import StructuredOutputs
    from qoqserve.server.tools import tool_structural_tag

    grammars = reference_llm.engine.grammars
    fns = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    think = ("" if opened else "<think>") + "hm</think>\n"
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        spec = after_reasoning(StructuredOutputs(structural_tag=tool_structural_tag(fns, choice, True)), opened)
        assert xgr.GrammarMatcher(grammars.compile(spec)).accept_string(think + call), choice
    for kind, answer in ((dict(choice=["yes", "no"]), "no"), (dict(grammar='root ::= "a" | "b"'), "b"),
                         (dict(json_object=True), "{}"), (dict(regex="[0-9]+"), "42")):
        m = xgr.GrammarMatcher(grammars.compile(after_reasoning(StructuredOutputs(**kind), opened)))
        assert m.accept_string(think + answer), kind
        assert not xgr.GrammarMatcher(grammars.compile(after_reasoning(StructuredOutputs(**kind), opened))) \
            .accept_string(think + "<think>"), kind


def test_reasoning_items_sent_back_go_to_the_next_assistant_turn():
    """Clients replay a response's `output` as the next `input`: its reasoning
    item is taken (not a 400) and reaches the template as reasoning_content."""
    from qoqserve.server.responses_protocol import ResponsesRequest, input_messages

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "call f"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "summary": []},  # nothing after it: dropped
        {"role": "user", "content": "and 3+3?"}]})
    msgs = input_messages(req.input)
    assert [m["role"] for m in msgs] == ["user", "assistant", "assistant", "tool", "user"]
    assert msgs[1]["reasoning_content"] == "add" and msgs[2]["reasoning_content"] == "call f"
    assert "reasoning_content" not in msgs[4]
