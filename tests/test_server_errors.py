"""Bad input gets an OpenAI-style 4xx and the server keeps serving correctly."""
from __future__ import annotations

import httpx
import pytest

KEY = {"Authorization": "Bearer test-key"}
LONG = "word " * 400  # > the test server's 256-token prompt limit, < its 64 KiB body limit
CTX = "word " * 250   # fits the prompt limit; with max_tokens 300 overflows the 512 context

# (case, path, body (dict, or raw bytes), headers, status, error type, param or code it must name)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', KEY, 400, "invalid_request_error", "invalid_json"),
    ("body not an object", "/v1/completions", b"[1, 2]", KEY, 400, "invalid_request_error", None),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, KEY, 400, "invalid_request_error", "prompt"),
    ("max_tokens is a string", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, KEY, 400,
     "invalid_request_error", "max_tokens"),
    ("temperature is a string", "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, KEY, 400,
     "invalid_request_error", "temperature"),
    ("stream is a number", "/v1/completions", {"prompt": "hi", "stream": 3}, KEY, 400,
     "invalid_request_error", "stream"),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, KEY, 404,
     "invalid_request_error", "model_not_found"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, KEY, 400, "invalid_request_error", "prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, KEY, 400, "invalid_request_error", "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999999]}, KEY, 400,
     "invalid_request_error", "prompt"),
    ("prompt over the limit", "/v1/completions", {"prompt": LONG}, KEY, 400, "invalid_request_error",
     "prompt_too_long"),
    ("body over the limit", "/v1/completions", {"prompt": "x" * 70000}, KEY, 413, "invalid_request_error",
     "body_too_large"),
    ("context overflow", "/v1/completions", {"prompt": CTX, "max_tokens": 300}, KEY, 400,
     "invalid_request_error", "context_length_exceeded"),
    ("max_tokens over the limit", "/v1/completions", {"prompt": "hi", "max_tokens": 5000}, KEY, 400,
     "invalid_request_error", "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, KEY, 400,
     "invalid_request_error", "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, KEY, 400,
     "invalid_request_error", "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, KEY, 400, "invalid_request_error", "top_p"),
    ("top_k negative", "/v1/completions", {"prompt": "hi", "top_k": -7}, KEY, 400, "invalid_request_error",
     "top_k"),
    ("presence_penalty out of range", "/v1/completions", {"prompt": "hi", "presence_penalty": 5}, KEY, 400,
     "invalid_request_error", "presence_penalty"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, KEY, 400, "invalid_request_error", "n"),
    ("n above 128", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129}, KEY, 400,
     "invalid_request_error", "n"),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "hi", "logit_bias": {"the": 1}}, KEY, 400,
     "invalid_request_error", "logit_bias"),
    ("logit_bias token beyond the vocabulary", "/v1/completions", {"prompt": "hi", "logit_bias": {"10000000": 1}},
     KEY, 400, "invalid_request_error", "logit_bias"),
    ("logit_bias above 100", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, KEY, 400,
     "invalid_request_error", "logit_bias"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 50}, KEY, 400,
     "invalid_request_error", "logprobs"),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, KEY, 400,
     "invalid_request_error", "stop"),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, KEY, 400, "invalid_request_error",
     "messages"),
    ("chat with an unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     KEY, 400, "invalid_request_error", "messages.0.role"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, KEY, 400,
     "invalid_request_error", "top_logprobs"),
    ("missing api key", "/v1/completions", {"prompt": "hi"}, {}, 401, "authentication_error", "invalid_api_key"),
    ("wrong api key", "/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer nope"}, 401,
     "authentication_error", "invalid_api_key"),
    ("unknown route", "/v1/nothing", {"prompt": "hi"}, KEY, 404, "not_found_error", None),
]


@pytest.mark.parametrize("case,path,body,headers,status,etype,names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_openai_error(server, case, path, body, headers, status, etype, names):
    kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": headers}
    r = httpx.post(server.base + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype
    assert err["message"]
    if names is not None:
        assert names in (err.get("param"), err.get("code")), err


def test_server_serves_correctly_after_bad_input(server, reference_llm):
    from qoqserve.sampling_params import SamplingParams

    for _, path, body, headers, *_ in CASES:  # the whole table again, then a good request
        kw = {"content": body, "headers": headers} if isinstance(body, bytes) else {"json": body,
                                                                                   "headers": headers}
        httpx.post(server.base + path, timeout=30, **kw)
    r = httpx.post(server.base + "/v1/completions", headers=KEY, timeout=60,
                   json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200
    ref = reference_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.json()["choices"][0]["text"] == ref.text
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200
