"""OpenAI's Responses API through the real openai client: a response is the
chat completion it asks for (same text, same usage), streamed as the
Responses events, continued by previous_response_id, with function tools
and text formats; its errors are 4xx naming the field."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

SYSTEM, QUESTION = "Answer in one short sentence.", "What is the capital of France?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat_text(client, model, messages, **kw):
    out = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content, out.usage


def test_a_response_is_its_chat_completion(client, model):
    r = client.responses.create(model=model, instructions=SYSTEM, input=QUESTION, max_output_tokens=24,
                                temperature=0)
    text, usage = chat_text(client, model, [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": QUESTION}], max_tokens=24)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text and [o.type for o in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    short = client.responses.create(model=model, input=QUESTION, max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_spell_the_same_response(client, model):
    kw = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
              max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation_and_stored_ones_can_be_read(client, model):
    first = client.responses.create(model=model, input=QUESTION, instructions=SYSTEM, max_output_tokens=24,
                                    temperature=0)
    follow = "And of Germany?"  # the instructions are not carried over (OpenAI's rule)
    second = client.responses.create(model=model, input=follow, previous_response_id=first.id,
                                     max_output_tokens=24, temperature=0)
    text, _ = chat_text(client, model, [{"role": "user", "content": QUESTION},
                                        {"role": "assistant", "content": first.output_text},
                                        {"role": "user", "content": follow}], max_tokens=24)
    assert second.output_text == text and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input=follow, previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=model, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_and_their_outputs(client, model):
    kw = dict(model=model, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    streamed = list(client.responses.create(stream=True, **kw))
    done = streamed[-1].response.output
    assert [(o.type, o.name, o.arguments) for o in done] == [(c.type, c.name, c.arguments) for c in calls]
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") \
        == calls[0].arguments
    call, result = calls[0], "Sunny, 21 C"
    answer = client.responses.create(model=model, tools=TOOLS, max_output_tokens=24, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    as_chat = client.chat.completions.create(
        model=model, max_tokens=24, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": "get_weather", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": result}]).choices[0].message
    assert answer.output_text == (as_chat.content or "")
    assert [(o.name, o.arguments) for o in answer.output if o.type == "function_call"] == [
        (c.function.name, c.function.arguments) for c in as_chat.tool_calls or []]


def test_text_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=model, input="Name a city and its country as JSON.", temperature=0,
                                max_output_tokens=60, text={"format": {"type": "json_schema", "name": "place",
                                                                       "schema": schema}})
    assert set(json.loads(r.output_text)) == {"city", "country"}
    assert r.text.format.type == "json_schema"


def test_a_background_response_runs_on_and_can_be_cancelled(client, model, server):
    import time

    kw = dict(model=model, input=QUESTION, max_output_tokens=24, temperature=0)
    r = client.responses.create(background=True, **kw)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        r = client.responses.retrieve(r.id)
    assert r.status == "completed" and r.output_text == client.responses.create(**kw).output_text
    assert client.responses.cancel(r.id).status == "completed"  # over already: nothing to cancel
    long = client.responses.create(background=True, model=model, input=QUESTION, max_output_tokens=250,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while httpx.get(server.base + "/health").json()["num_running"]:  # its request is aborted
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert not client.responses.retrieve(long.id).output
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(**kw).id)  # not a background one


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "background": True, "store": False}, "store"),
    ({"input": "hi", "background": True, "stream": True}, "stream")])
def test_bad_requests_name_the_field(server, body, param):
    r = httpx.post(server.base + "/v1/responses", json=body, timeout=60, headers={"Authorization": "Bearer test-key"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
