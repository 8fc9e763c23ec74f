"""schemathesis against the published /openapi.json: both POST endpoints get
generated bodies (valid ones and, in its negative mode, ones that break the
schema); every answer is a documented status, never a 5xx, every 4xx an
OpenAI-shaped error, and afterwards the server still answers a normal request
with the reference greedy output and holds no page.

Bounded and deterministic for CI: EXAMPLES per endpoint, derandomized (the
same cases every run), and valid requests are cut to MAX_NEW tokens because
generation, not validation, is what costs time.
"""
from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance
from test_server_load import assert_still_serving

from qoqserve.server.responses import ErrorResponse

KEY = {"Authorization": "Bearer test-key"}
EXAMPLES = 100
MAX_NEW = 2
MAX_CHOICES = 2  # choices per valid request (n, and prompts in a list)


PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base + "/openapi.json")


def bound_generation(body):
    """A few new tokens per valid request: a generated max_tokens of 300 would
    spend the time budget on generation; invalid values (wrong type, < 1)
    are kept, so they still get their 400. Likewise at most MAX_CHOICES
    choices."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            v = body.get(key)
            if type(v) is int and v > MAX_NEW:
                body[key] = MAX_NEW
        if not any(k in body for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
            body["max_output_tokens" if "input" in body else "max_tokens"] = MAX_NEW
        if type(body.get("n")) is int and body["n"] > MAX_CHOICES:  # n up to 128 is valid
            body["n"] = MAX_CHOICES
        if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], (str, list)):
            body["prompt"] = body["prompt"][:MAX_CHOICES]  # a list of prompts: a choice each
    return body


REFUSED = ("model", "best_of", "suffix", "logit_bias", "tools", "response_format", "echo",
           "top_logprobs", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "previous_response_id",
           "text", "tool_choice", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "min_tokens")


def without_refused(case):
    """An allowed body the server can also accept: without REFUSED, and (chat)
    one user turn (generated role sequences rarely pass the chat template)."""
    if isinstance(case.body, dict):
        body = {k: v for k, v in case.body.items() if k not in REFUSED}
        if isinstance(body.get("messages"), list):
            first = body["messages"][0] if body["messages"] else {}
            content = first.get("content") if isinstance(first, dict) else None
            body["messages"] = [{"role": "user", "content": content if isinstance(content, str) and content
                                 else "hi"}]
        for key in ("input", "prompt"):  # generated items and token ids rarely pass
            if key in body and not isinstance(body[key], str):
                body[key] = "hi"
        case.body = body
    return case


def check_error_shape(r) -> None:
    if r.status_code >= 400:
        err = ErrorResponse.model_validate(r.json()).error
        assert err.message and err.type, r.text


def check_answer(r) -> None:
    assert r.status_code < 500, r.text
    check_error_shape(r)
    if r.status_code == 200 and "text/event-stream" in r.headers.get("content-type", ""):
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        if r.request.url.path == "/v1/responses":  # no [DONE]: the last event ends it
            assert json.loads(lines[-1][6:])["type"] in ("response.completed", "response.incomplete"), r.text
            return
        assert lines[-1] == "data: [DONE]", r.text
        assert not any("error" in json.loads(ln[6:]) for ln in lines[:-1]), r.text


@pytest.mark.parametrize("path", PATHS)
def test_schemathesis_every_answer_is_documented_never_5xx(api_schema, server, reference_llm, path):
    op = api_schema[path]["POST"]
    # both of schemathesis's modes, bodies the schema allows and bodies it must
    # refuse, and allowed bodies without the fields the server refuses beyond the
    # schema (best_of, suffix...: else nearly every allowed body is a 400 too)
    positive = op.as_strategy(GenerationMode.POSITIVE)
    cases = st.one_of(positive, op.as_strategy(GenerationMode.NEGATIVE), positive.map(without_refused))
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def fuzz(case):
        case.body = bound_generation(case.body)
        r = case.call(base_url=server.base, headers=KEY, timeout=60)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        # documented status (200 or the 4XX/5XX ranges) ...
        case.validate_response(r, checks=[not_a_server_error, status_code_conformance])
        check_answer(r)  # ... and of those never a 5xx, every error OpenAI-shaped

    fuzz()
    print(f"{path}: {EXAMPLES} examples, statuses {statuses}")
    # the run really exercised the endpoint, with accepted and refused bodies
    # (schemathesis's own choices are not all seeded: the counts vary a little)
    assert sum(statuses.values()) >= EXAMPLES and statuses.get(200, 0) >= 3 and statuses.get(400, 0) >= 10, \
        statuses
    assert_still_serving(server, reference_llm)
