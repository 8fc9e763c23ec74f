"""Edges of the HTTP API: a request that could once break a step, invalid
text, huge bodies, null content, odd methods, and the published schema."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from qoqserve.sampling_params import SamplingParams
from qoqserve.server.responses import ChatCompletionResponse, CompletionResponse, ErrorResponse

KEY = {"Authorization": "Bearer test-key"}
PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is",
           "The quick brown fox"]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(server, path, body, **kw):
    return httpx.post(server.base + path, json=body, headers={**KEY, **kw.pop("headers", {})},
                      timeout=kw.pop("timeout", 60), **kw)


def openai_error(r: httpx.Response, status: int):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return ErrorResponse.model_validate(r.json()).error


def test_seeds_beyond_64_bits_are_refused_while_four_streams_finish(server, reference_llm):
    """The issue's kill-the-batch case: 2**70 once overflowed inside a step and
    failed every request in flight."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    refs = [o.text for o in reference_llm.generate(PROMPTS, params)]

    async def run():
        async with httpx.AsyncClient(timeout=120, headers=KEY) as client:
            started = asyncio.Event()

            async def one(prompt):
                body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                text, reason = "", None
                async with client.stream("POST", server.base + COMPLETIONS, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            text, reason = text + choice["text"], choice["finish_reason"] or reason
                            started.set()
                return text, reason

            streams = [asyncio.create_task(one(p)) for p in PROMPTS]
            await started.wait()
            seeded = {}
            for seed in (2**70, 2**64, -2**63 - 1, 2**64 - 1):
                seeded[seed] = await client.post(server.base + COMPLETIONS, json={
                    "prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "seed": seed})
            return await asyncio.gather(*streams), seeded

    results, seeded = asyncio.run(run())
    assert results == [(ref, "length") for ref in refs]
    for seed in (2**70, 2**64, -2**63 - 1):
        assert openai_error(seeded[seed], 400).param == "seed"
    assert seeded[2**64 - 1].status_code == 200  # the largest seed a generator takes is fine


SURROGATE_CASES = [
    (COMPLETIONS, b'{"prompt": "hi \\ud800 there"}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["\\udfff"]}', "prompt"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    (COMPLETIONS, b'{"prompt": "hi", "model": "\\ud83d"}', "model"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
     "messages.0.content"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_CASES, ids=[c[2] + c[0] for c in SURROGATE_CASES])
def test_lone_surrogates_are_a_400(server, path, raw, param):
    r = httpx.post(server.base + path, content=raw, timeout=30,
                   headers={**KEY, "Content-Type": "application/json"})
    err = openai_error(r, 400)
    assert err.param is not None and err.param.startswith(param) and err.code == "invalid_text", err


def test_a_20_mb_body_gets_a_413_json_error_unread(server):
    big = b'{"prompt": "' + b"x" * 20_000_000 + b'"}'
    err = openai_error(httpx.post(server.base + COMPLETIONS, content=big, headers=KEY, timeout=60), 413)
    assert err.code == "body_too_large"

    def chunks():  # no Content-Length: the limit is counted as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(200):
            yield b"y" * 100_000
        yield b'"}'

    r = httpx.post(server.base + COMPLETIONS, content=chunks(), headers=KEY, timeout=60)
    assert openai_error(r, 413).code == "body_too_large"
    assert post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_null_content_is_refused_except_on_an_assistant_tool_call(server):
    for messages in ([{"role": "user", "content": None}], [{"role": "user"}],
                     [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]):
        err = openai_error(post(server, CHAT, {"messages": messages}), 400)
        assert err.param.startswith("messages.") and err.param.endswith(".content"), err
        assert err.code == "content_required"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = post(server, CHAT, {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "and now?"}]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("method,path,allow", [
    ("TRACE", COMPLETIONS, "POST"), ("PUT", CHAT, "POST"), ("DELETE", "/v1/models", "GET"),
    ("TRACE", "/health", "GET"), ("BREW", COMPLETIONS, "POST")])
def test_other_methods_are_a_405_with_allow(server, method, path, allow):
    r = httpx.request(method, server.base + path, headers=KEY, timeout=30)
    openai_error(r, 405)
    assert r.headers["allow"] == allow


def test_every_error_is_openai_shaped(server):
    assert openai_error(httpx.get(server.base + "/nowhere"), 404).type == "not_found_error"
    assert openai_error(httpx.get(server.base + COMPLETIONS, headers=KEY), 405).message
    assert openai_error(post(server, COMPLETIONS, {"prompt": 3}), 400).param == "prompt"
    for raw, param in ((b'{"prompt": "hi", "top_p": NaN}', "top_p"),
                       (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
                       (b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias")):
        r = httpx.post(server.base + COMPLETIONS, content=raw, headers=KEY)
        assert openai_error(r, 400).param.startswith(param)
    r = httpx.post(server.base + COMPLETIONS, content=b"\xff\xfe{}", headers=KEY)
    openai_error(r, 400)
    assert openai_error(httpx.post(server.base + COMPLETIONS, json={"prompt": "hi"}), 401)


def test_openapi_publishes_the_request_and_response_schemas(server):
    spec = httpx.get(server.base + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name, field, resp in ((COMPLETIONS, "CompletionRequest", "prompt", "CompletionResponse"),
                                    (CHAT, "ChatCompletionRequest", "messages", "ChatCompletionResponse")):
        op = spec["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"]
        assert body["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{name}"
        assert field in schemas[name]["required"]
        temp = schemas[name]["properties"]["temperature"]["anyOf"][0]
        assert (temp["minimum"], temp["maximum"]) == (0, 100)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(resp)
        assert "422" not in op["responses"] and "4XX" in op["responses"]  # we answer 400, not 422
    docs = httpx.get(server.base + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_real_responses_match_the_published_schemas(server):
    r = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "logprobs": 2})
    CompletionResponse.model_validate(r.json())
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                            "logprobs": True, "top_logprobs": 2})
    ChatCompletionResponse.model_validate(r.json())
