"""Several choices in one response: `n` on both endpoints and a list of prompts
on /v1/completions (server/choices.py), against single requests and the
offline engine."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_load import wait_idle

from qoqserve.sampling_params import SEED_RANGE, SamplingParams

KEY = {"Authorization": "Bearer test-key"}
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPTS = ["The three primary colors are", "Once upon a time", "1, 2, 3,"]


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base + path, json=body, headers=KEY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.base + path, json={**body, "stream": True}, headers=KEY, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_seeded_choices_are_the_single_requests_with_seed_plus_index(server):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 1.0, "seed": 11}
    got = post(server, "/v1/chat/completions", {**body, "n": 3})
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in got["choices"]]
    singles = [post(server, "/v1/chat/completions", {**body, "seed": 11 + i})["choices"][0]["message"]["content"]
               for i in range(3)]
    assert texts == singles
    assert len(set(texts)) > 1  # sampled apart, not one answer three times
    usage = got["usage"]
    single = post(server, "/v1/chat/completions", body)["usage"]
    assert usage["prompt_tokens"] == single["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == sum(
        post(server, "/v1/chat/completions", {**body, "seed": 11 + i})["usage"]["completion_tokens"]
        for i in range(3))


def test_the_largest_seed_wraps_for_the_next_choice(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0}
    got = post(server, "/v1/completions", {**body, "n": 2, "seed": SEED_RANGE[1]})
    wrapped = post(server, "/v1/completions", {**body, "seed": SEED_RANGE[0]})
    assert got["choices"][1]["text"] == wrapped["choices"][0]["text"]


def test_a_list_of_prompts_gets_n_greedy_choices_each(server, reference_llm):
    got = post(server, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 10, "temperature": 0})
    refs = [reference_llm.generate(p, SamplingParams(temperature=0, max_tokens=10))[0] for p in PROMPTS]
    assert [c["index"] for c in got["choices"]] == list(range(2 * len(PROMPTS)))
    for c in got["choices"]:
        ref = refs[c["index"] // 2]
        assert c["text"] == ref.text and c["finish_reason"] == ref.finish_reason
    assert got["usage"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in refs)
    assert got["usage"]["completion_tokens"] == 2 * sum(len(r.token_ids) for r in refs)


def test_token_id_prompts_and_echo_per_prompt(server, reference_llm):
    ids = [reference_llm.engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    got = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True})
    for c, p in zip(got["choices"], ids):
        assert c["text"].startswith(reference_llm.engine.tokenizer.decode(p))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_of_several_choices_equals_the_response(server, path):
    chat = path.endswith("chat/completions")
    body = ({"messages": CHAT} if chat else {"prompt": PROMPTS[:2]}) | {"n": 2, "max_tokens": 12, "temperature": 0.8,
                                                                          "seed": 5}
    full = post(server, path, body)
    chunks = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != full["id"]
    texts, reasons, roles = {}, {}, {}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]  # one choice per chunk, named by its index
        part = c["delta"].get("content") if chat else c["text"]
        texts[c["index"]] = texts.get(c["index"], "") + (part or "")
        if chat and "role" in c["delta"]:
            roles[c["index"]] = roles.get(c["index"], 0) + 1
        if c["finish_reason"]:
            assert c["index"] not in reasons  # one finish per choice
            reasons[c["index"]] = c["finish_reason"]
    want = {c["index"]: (c["message"]["content"] if chat else c["text"]) for c in full["choices"]}
    assert texts == want
    assert reasons == {c["index"]: c["finish_reason"] for c in full["choices"]}
    if chat:
        assert roles == {i: 1 for i in want}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_the_choices_of_a_prompt_share_its_pages(server):
    """The first choice prefills; the others start once the prompt's full
    pages are cached, so they hit the prefix cache for all of them."""
    prompt = " ".join(f"term{i}" for i in range(60))  # several full 16-token pages, none cached yet
    wait_idle(server)
    before = server.metrics()["vllm:prefix_cache_hits_total"]
    got = post(server, "/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 3, "temperature": 1.0, "seed": 0})
    n_tokens = got["usage"]["prompt_tokens"]
    hits = server.metrics()["vllm:prefix_cache_hits_total"] - before
    assert n_tokens > 64 and hits >= 3 * ((n_tokens - 1) // 16) * 16


def test_hanging_up_on_several_choices_frees_every_page(server, reference_llm):
    with httpx.stream("POST", server.base + "/v1/completions", headers=KEY, timeout=60,
                      json={"prompt": PROMPTS[:2], "n": 3, "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) >= 4:
                break
    wait_idle(server)  # all six requests aborted, every page back
    r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    ref = reference_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))[0]
    assert r["choices"][0]["text"] == ref.text


def test_a_bad_prompt_among_several_is_a_400_and_starts_nothing(server):
    wait_idle(server)
    before = server.metrics()["vllm:prompt_tokens_total"]
    r = httpx.post(server.base + "/v1/completions", headers=KEY, timeout=60,
                   json={"prompt": ["fine", "x " * 400], "n": 2, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    wait_idle(server)
    assert server.metrics()["vllm:prompt_tokens_total"] == before
