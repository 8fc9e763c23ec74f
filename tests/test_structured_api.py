"""Structured outputs and tool calls through the real openai client: a
pydantic model via chat.completions.parse, regex and choice, a tool-call
round trip, streaming of each, a mixed batch, and bad specs as 400s.

The server runs in this process over the session's offline engine (fp32
embedded SmolLM2-135M), as in test_server_faults.py.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import in_process_server
from pydantic import BaseModel, Field

from qoqserve.server.responses import ChatCompletionResponse, ErrorResponse


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population: int = Field(ge=0, le=100_000_000)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PHONE = r"\d{3}-\d{4}"


@pytest.fixture(scope="module")
def live(reference_llm):
    with in_process_server(reference_llm.engine) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def parallel(fns):
    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(lambda f: f(), fns))


def stream_text(chunks) -> tuple[str, str | None]:
    chunks = list(chunks)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
        chunks[-1].choices[0].finish_reason


def test_parse_with_a_pydantic_model_gives_valid_objects_greedy_and_sampled(client, model):
    # (prompt, seed): greedy where None. Not every prompt works greedy: "Give me a
    # big city." makes the 135M model pad every gap with newlines until max_tokens
    # (docs/server.md); its sampled answer with this seed is fine
    runs = [("Describe Paris as JSON.", None), ("A city in Japan, please.", None),
            ("Describe Paris as JSON.", 2), ("Give me a big city.", 1), ("A city in Japan, please.", 2)]
    results = parallel([lambda p=p, s=s: client.chat.completions.parse(
        model=model, response_format=City, max_tokens=64, messages=[{"role": "user", "content": p}],
        temperature=0 if s is None else 1.0, seed=s) for p, s in runs])
    for r in results:
        assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content
    # streamed: the same text as the greedy answer
    text, reason = stream_text(client.chat.completions.create(
        model=model, stream=True, max_tokens=64, temperature=0, messages=[{"role": "user", "content": runs[0][0]}],
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}))
    assert text == results[0].choices[0].message.content and reason == "stop"


def test_regex_and_choice_on_both_endpoints_streamed_or_not(client, model):
    chat = dict(model=model, messages=[{"role": "user", "content": "A phone number?"}], max_tokens=12,
                temperature=0, extra_body={"structured_outputs": {"regex": PHONE}})
    full = client.chat.completions.create(**chat).choices[0].message.content
    assert re.fullmatch(PHONE, full)
    assert stream_text(client.chat.completions.create(stream=True, **chat)) == (full, "stop")
    choices = ["yes", "no", "maybe"]
    comp = dict(model=model, prompt="Is the sky green? Answer:", max_tokens=8, temperature=0.9, seed=5,
                extra_body={"structured_outputs": {"choice": choices}})
    full = client.completions.create(**comp).choices[0]
    assert full.text in choices and full.finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **comp))
    assert "".join(c.choices[0].text for c in chunks) == full.text
    # vLLM's older field, and json_object on completions
    old = client.completions.create(model=model, prompt="Pick:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": choices})
    assert old.choices[0].text in choices
    obj = client.completions.create(model=model, prompt="A JSON object:", max_tokens=24, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].text
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_tool_call_round_trip_streamed_and_not(client, model):
    # one call: with parallel calls allowed the 135M model repeats the same call until max_tokens
    kw = dict(model=model, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0, parallel_tool_calls=False)
    first = client.chat.completions.create(tool_choice="required", **kw)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # streamed: the deltas add up to the same call
    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a named function: exactly one call of it
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw).choices[0].message
    assert [c.function.name for c in named.tool_calls] == ["get_weather"]
    # the tool's answer goes back; the model answers in text
    turn = ASK + [msg.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=model, messages=turn, tools=[WEATHER], tool_choice="none",
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    # auto: the model may answer in text; whatever it does is well formed
    auto = client.chat.completions.create(tool_choice="auto", **{**kw, "max_tokens": 8}).choices[0]
    assert auto.message.content or auto.message.tool_calls


def test_a_mixed_batch_gives_free_requests_their_own_output(live, client, model):
    free = [dict(prompt=p, max_tokens=10, temperature=0) for p in ("The capital of France is", "Water boils at")]
    alone = parallel([lambda f=f: client.completions.create(model=model, **f).choices[0].text for f in free])
    held = dict(messages=[{"role": "user", "content": "A city as JSON."}], max_tokens=24, temperature=0,
                extra_body={"structured_outputs": {"json": City.model_json_schema()}})
    mixed = parallel([lambda f=f: client.completions.create(model=model, **f).choices[0].text for f in free]
                     + [lambda: client.chat.completions.create(model=model, **held).choices[0].message.content] * 2)
    assert mixed[:2] == alone
    assert mixed[2] == mixed[3]


BAD = [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}},
     "structured_outputs", "unsupported_schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid_grammar"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "invalid_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "objectx"}}}]},
     "tools", "unsupported_schema"),
]


def test_bad_specs_get_a_400_naming_the_problem_and_the_server_goes_on(live, client, model):
    for extra, param, code in BAD:
        r = httpx.post(live + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = ErrorResponse.model_validate(r.json()).error
        assert err.param == param and (code is None or err.code == code), (extra, r.text)
    r = httpx.post(live + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": ASK, "max_tokens": 40, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False})
    assert r.status_code == 200
    ChatCompletionResponse.model_validate(r.json())  # the documented schema holds tool calls


def test_a_grammar_the_vocabulary_cannot_spell_ends_that_request_alone(live, client, model):
    """A choice holding U+7EF0B needs byte 0xF1 alone, which SmolLM2's vocabulary
    has no token for: the grammar dead-ends after "D". That request gets a 400
    (an error event once streaming), the requests beside it their own output,
    and the server's health does not change (a request fault, not an engine fault)."""
    unspellable = {"messages": [{"role": "user", "content": "t"}], "max_tokens": 5,
                   "structured_outputs": {"choice": ["D\U0007ef0bK"]}}
    free = dict(prompt="The capital of France is", max_tokens=10, temperature=0)
    alone = client.completions.create(model=model, **free).choices[0].text
    before = httpx.get(live + "/health").json()

    def dead(stream: bool):
        body = json.dumps({**unspellable, "stream": stream}).encode()
        return httpx.post(live + "/v1/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})

    got = parallel([lambda: client.completions.create(model=model, **free).choices[0].text,
                    lambda: dead(False), lambda: dead(True)])
    assert got[0] == alone
    assert got[1].status_code == 400 and got[1].json()["error"]["code"] == "constraint_dead_end"
    events = [json.loads(ln[6:]) for ln in got[2].text.splitlines() if ln.startswith("data: {")]
    assert got[2].status_code == 200 and events[-1]["error"]["code"] == "constraint_dead_end"
    assert got[2].text.rstrip().endswith("data: [DONE]")
    after = httpx.get(live + "/health").json()
    # the engine is the session's (fault tests may have left it "degraded" before): nothing new
    assert after["status"] == before["status"] and after["engine_faults"] == before["engine_faults"]
    assert after["request_faults"] == before["request_faults"] + 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_top_logprobs_beyond_what_the_grammar_allows_are_floored_not_minus_infinity(live, path):
    """A choice allows one token per step; 5 top logprobs ask for tokens it rules
    out (-inf, which JSON cannot carry): they get vLLM's floor, -9999."""
    chat = path.endswith("chat/completions")
    body = ({"messages": [{"role": "user", "content": "Pick."}], "logprobs": True, "top_logprobs": 5} if chat
            else {"prompt": "Pick:", "logprobs": 5}) | {"max_tokens": 3, "temperature": 0,
                                                        "structured_outputs": {"choice": ["yes"]}}
    r = httpx.post(live + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tops = [[t["logprob"] for t in e["top_logprobs"]] for e in lp["content"]] if chat else \
        [list(e.values()) for e in lp["top_logprobs"]]
    assert all(len(t) == 5 and t[0] > -9999.0 and min(t) == -9999.0 for t in tops), tops


def test_each_of_n_choices_has_its_own_grammar_state(client, model):
    got = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A phone number?"}], max_tokens=12, n=3,
        temperature=1.0, seed=7, extra_body={"structured_outputs": {"regex": PHONE}})
    texts = [c.message.content for c in got.choices]
    assert all(re.fullmatch(PHONE, t) for t in texts) and len(set(texts)) > 1, texts
    assert [c.finish_reason for c in got.choices] == ["stop"] * 3
