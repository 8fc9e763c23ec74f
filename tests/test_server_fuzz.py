"""Requests generated from the server's own /openapi.json, valid and broken,
get a documented answer: 200, or an OpenAI-shaped 4xx; never a 5xx, a hang
or a dropped connection; and the server serves a normal request correctly
afterwards with every page back.

A small hand-written generator (schemathesis is not a dependency): it walks
the published request schemas ($ref, anyOf, const/enum, min/max, required)
to build a valid body, then usually breaks it: a wrong type, a value past a
bound, a huge or non-finite number, a lone surrogate, a missing required
field, an unknown field, a body that is not an object or not JSON. Seeded,
so a failure replays; CASES bounds the time (about 15 s here).
"""
from __future__ import annotations

import json
import random

import httpx
import pytest
from test_server_load import assert_still_serving

from qoqserve.server.responses import ErrorResponse

KEY = {"Authorization": "Bearer test-key"}
CASES = 200
SEED = 18
MAX_NEW = 2  # generation is the slow part: valid requests ask for a few tokens only
STATUSES = {200, 400, 404, 413}
WORDS = ["hello", "the", "Paris", "é", "中文", "🙂", "\n", " ", "<|im_end|>", "\\", '"', "\x00"]


class Gen:
    def __init__(self, spec: dict, rng: random.Random):
        self.schemas = spec["components"]["schemas"]
        self.rng = rng

    def resolve(self, s: dict) -> dict:
        while "$ref" in s:
            s = self.schemas[s["$ref"].rsplit("/", 1)[1]]
        return s

    def text(self) -> str:
        return "".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 6)))

    def valid(self, s: dict, depth: int = 0):
        r, s = self.rng, self.resolve(s)
        if "anyOf" in s:
            return self.valid(r.choice(s["anyOf"]), depth)
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return r.choice(s["enum"])
        t = s.get("type")
        if t == "object" or "properties" in s:
            props, required = s.get("properties", {}), s.get("required", [])
            # a few optional fields: with all of them some semantic refusal (n, tools...) is certain
            optional = [k for k in props if k not in required]
            chosen = set(r.sample(optional, min(len(optional), r.randint(0, 3)))) if depth < 3 else set()
            return {k: self.valid(v, depth + 1) for k, v in props.items() if k in required or k in chosen}
        if t == "array":
            return [self.valid(s.get("items", {}), depth + 1) for _ in range(r.randint(0 if depth else 1, 3))]
        if t == "string":
            return self.text()
        if t in ("integer", "number"):
            lo = s.get("minimum", s.get("exclusiveMinimum", -5))
            hi = s.get("maximum", 50)
            v = r.uniform(lo, hi) if t == "number" else r.randint(int(lo), int(min(hi, lo + 100)))
            return v if t == "number" and v != s.get("exclusiveMinimum") else v or 1
        if t == "boolean":
            return r.random() < 0.5
        if t == "null":
            return None
        return r.choice([None, 1, "x", [], {}])  # no schema: anything

    def broken(self, s: dict):
        """A value the schema does not allow (or might not: it is a fuzzer)."""
        r, s = self.rng, self.resolve(s)
        return r.choice([
            "\ud800", 2**70, -2**70, 1e308, "1", True, None, [], {}, [[[]]], {"a": {"b": [1]}},
            s.get("maximum", 10**6) + 1 if "maximum" in s else -1, "x" * 3000, 0, -1, 0.5])

    def body(self, schema_name: str):
        r = self.rng
        body = self.valid({"$ref": f"#/components/schemas/{schema_name}"})
        kind = r.random()
        if kind < 0.25:
            return body, "valid"
        props = self.resolve({"$ref": f"#/components/schemas/{schema_name}"})["properties"]
        if kind < 0.75:
            for _ in range(r.randint(1, 3)):
                key = r.choice(sorted(props))
                body[key] = self.broken(props[key]) if r.random() < 0.7 else self.valid(props[key])
        elif kind < 0.85:
            body.pop(r.choice(sorted(body)), None)
            body[self.text()] = self.broken({})
        else:
            return r.choice([b"", b"[]", b"null", b'"s"', b"{", b'{"prompt": NaN}', b"\xff\xfe",
                             json.dumps([body]).encode(), b'{"a":' * 300 + b"1" + b"}" * 300]), "raw"
        return body, "broken"


def bound_generation(body):
    """Keep valid requests short: a few new tokens, never "the rest of the context"."""
    if not isinstance(body, dict):
        return body
    limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for key in limits:
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_NEW:
            body[key] = 1 + v % MAX_NEW
    if not any(isinstance(body.get(k), int) for k in limits):
        body["max_output_tokens" if "input" in body else "max_tokens"] = MAX_NEW
    if isinstance(body.get("min_tokens"), int) and not isinstance(body["min_tokens"], bool):
        body["min_tokens"] = min(body["min_tokens"], 10**6)  # large ones stay invalid
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and 2 < body["n"] <= 128:
        body["n"] = 2  # valid up to 128; each choice generates
    if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], (str, list)):
        body["prompt"] = body["prompt"][:2]  # a list of prompts: a choice each
    return body


def check(r: httpx.Response, stream: bool, what: str):
    assert r.status_code in STATUSES, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code != 200:
        err = ErrorResponse.model_validate(r.json()).error
        assert err.message and err.type == ("not_found_error" if r.status_code == 404 and err.code
                                            != "model_not_found" else "invalid_request_error"), what
        return
    responses = r.request.url.path == "/v1/responses"
    if stream:
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        if responses:  # no [DONE]: the last event ends it
            assert json.loads(lines[-1][6:])["type"] in ("response.completed", "response.incomplete"), what
            return
        assert lines[-1] == "data: [DONE]", what
        for ln in lines[:-1]:
            assert "error" not in json.loads(ln[6:]), f"{what}: {ln}"
    else:
        assert r.json()["output" if responses else "choices"], what


def test_schema_driven_fuzz_never_gets_a_5xx(server, reference_llm):
    spec = httpx.get(server.base + "/openapi.json").json()
    targets = []
    for path, op in spec["paths"].items():
        post = op.get("post")
        if post and "requestBody" in post and path.startswith("/v1/"):  # the generation endpoints
            ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            targets.append((path, ref.rsplit("/", 1)[1]))
    assert sorted(p for p, _ in targets) == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    gen = Gen(spec, random.Random(SEED))
    seen = {"valid": 0, "broken": 0, "raw": 0}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.base, headers=KEY, timeout=60) as client:
        for i in range(CASES):
            path, schema = targets[i % len(targets)]
            body, kind = gen.body(schema)
            seen[kind] += 1
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"Content-Type": "application/json"})
                stream = False
            else:
                body = bound_generation(body)
                raw = json.dumps(body).encode()  # ASCII escapes carry lone surrogates through
                r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
                stream = body.get("stream") is True
            check(r, stream, f"case {i} {path} {kind}: {body!r:.300}")
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    # the generator really produced both kinds, and both kinds of answer
    assert min(seen.values()) >= 10 and statuses.get(200, 0) >= 15 and statuses.get(400, 0) >= 50, \
        (seen, statuses)
    assert_still_serving(server, reference_llm)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_generator_breaks_requests_in_many_ways(seed):
    """Guards the fuzzer itself: it makes valid bodies and distinct broken ones."""
    spec = {"components": {"schemas": {"R": {"type": "object", "required": ["p"], "properties": {
        "p": {"type": "string"}, "t": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 2},
                                                 {"type": "null"}]}}}}}}
    gen = Gen(spec, random.Random(seed))
    bodies = [gen.body("R") for _ in range(100)]
    valid = [b for b, k in bodies if k == "valid"]
    assert valid and all(isinstance(b["p"], str) and (b.get("t") is None or 0 <= b["t"] <= 2) for b in valid)
    assert len({repr(b) for b, k in bodies if k != "valid"}) > 30
