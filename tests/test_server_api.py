"""The server through the real openai client: outputs equal the offline engine's."""
from __future__ import annotations

import math

import httpx
import pytest

from qoqserve.sampling_params import SamplingParams

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, reference_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [reference_llm.engine.model_name]


def test_completion_equals_offline_generate_with_usage(client, model_id, reference_llm):
    got = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0)
    ref = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20))[0]
    assert got.choices[0].text == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_chat_equals_offline_chat(client, model_id, reference_llm):
    got = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0)
    ref = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.token_ids)


def test_streaming_chat_concatenates_to_the_full_answer(client, model_id):
    full = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len([c for c in chunks if c.choices]) > 3  # it really streamed


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, model_id):
    """vLLM's stream option: each content chunk carries the usage up to it."""
    chunks = list(client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    content = [c for c in chunks if c.choices]
    done = [c.usage.completion_tokens for c in content]
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in content)
    assert done == sorted(done) and done[-1] == chunks[-1].usage.completion_tokens == 12 and done[0] < 12
    plain = list(client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)  # only the last chunk, without the option


def test_streaming_completion_matches_non_streaming(client, model_id):
    full = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_output(client, model_id, reference_llm, stream):
    ref = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30))[0].text
    stop = ref.strip().split()[2]  # a word from the middle of the greedy answer
    kwargs = dict(model=model_id, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs).choices[0]
        text, reason = out.text, out.finish_reason
    assert text == ref[:ref.index(stop)]
    assert reason == "stop"


def test_completion_logprobs_equal_the_engine_logprobs(client, model_id, reference_llm):
    got = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logprobs=3).choices[0].logprobs
    ref = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=True,
                                                        top_logprobs=3))[0]
    tok = reference_llm.tokenizer
    assert got.tokens == [tok.token_to_str(t) for t in ref.token_ids]
    assert got.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    for top, ref_top, chosen, lp in zip(got.top_logprobs, ref.top_logprobs, got.tokens, got.token_logprobs):
        assert len(top) == 3
        assert top[chosen] == pytest.approx(lp, abs=1e-5)  # greedy: the chosen token is the best
        assert list(top.values()) == pytest.approx([v for _, v in ref_top], abs=1e-5)
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)


def test_chat_logprobs_with_top_logprobs(client, model_id):
    out = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2).choices[0]
    content = out.logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == out.message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token
        assert sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1.0 + 1e-6


def test_logit_bias_steers_the_output_as_offline(client, model_id, reference_llm):
    tok = reference_llm.engine.tokenizer
    plain = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0]
    banned = plain.token_ids[0]
    bias = {banned: -100, tok.encode(" blue", add_special_tokens=False)[0]: 5}
    ref = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias=bias))[0]
    got = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={str(t): b for t, b in bias.items()})
    assert got.choices[0].text == ref.text and banned not in ref.token_ids and ref.text != plain.text
    forced = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0.7, seed=1,
                                       logit_bias={str(banned): 100})
    assert forced.choices[0].text == tok.decode([banned] * 4)


def test_seeded_sampling_is_reproducible(client, model_id):
    kw = dict(model=model_id, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_token_id_prompt_and_echo(client, model_id, reference_llm):
    ids = reference_llm.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0,
                                        echo=True)
    assert by_text.choices[0].text == PROMPT + by_ids.choices[0].text


def test_serve_freezes_its_start_up_heap(server):
    """`serve` takes the heap it built at start-up (model, tokenizer, libraries:
    hundreds of thousands of objects) out of the collector's walks, so no full
    collection stalls the engine loop mid-stream."""
    assert httpx.get(server.base + "/health").json()["gc_frozen_objects"] > 50_000


def test_health_and_metrics_count_the_work(server, client, model_id):
    assert httpx.get(server.base + "/health").status_code == 200
    before = server.metrics()
    client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 1
    assert after["vllm:e2e_request_latency_seconds_count"] > before.get(
        "vllm:e2e_request_latency_seconds_count", 0)
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_sum", "vllm:time_per_output_token_seconds_sum",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"):
        assert name in after


def test_skip_special_tokens_false_writes_them_out(server, reference_llm):
    """vLLM's field: the end-of-turn token, forced by a logit bias and kept
    going by ignore_eos, is spelled out only when asked."""
    tok = reference_llm.engine.tokenizer
    eos = tok.eos_token_ids[0]
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    ask = lambda **kw: httpx.post(server.base + "/v1/completions", json={**body, **kw}, timeout=60,  # noqa: E731
                                  headers={"Authorization": "Bearer test-key"}).json()["choices"][0]["text"]
    assert ask() == ""
    assert ask(skip_special_tokens=False) == tok.token_to_str(eos) * 3


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, reference_llm):
    """vLLM's field: every token logprobs name (chosen and top, both
    endpoints) is "token_id:N", N the token that the plain request names by text."""
    post = lambda path, **kw: httpx.post(server.base + path, timeout=60, headers={"Authorization": "Bearer test-key"},  # noqa: E731
                                         json={"max_tokens": 4, "temperature": 0, **kw}).json()["choices"][0]
    tok = reference_llm.engine.tokenizer
    plain = post("/v1/completions", prompt=PROMPT, logprobs=2)["logprobs"]
    named = post("/v1/completions", prompt=PROMPT, logprobs=2, return_tokens_as_token_ids=True)["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in named["tokens"]]
    assert [tok.token_to_str(t) for t in ids] == plain["tokens"] and named["text_offset"] == plain["text_offset"]
    assert [[tok.token_to_str(int(k.removeprefix("token_id:"))) for k in top] for top in named["top_logprobs"]] \
        == [list(top) for top in plain["top_logprobs"]]
    chat = post("/v1/chat/completions", messages=CHAT, logprobs=True, top_logprobs=2,
                return_tokens_as_token_ids=True)["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") and all(t["token"].startswith("token_id:") for t in e["top_logprobs"])
               for e in chat)


def test_add_special_tokens_puts_bos_where_the_request_says(reference_llm, monkeypatch):
    """vLLM's field, on a tokenizer that wants BOS (the embedded one does not:
    made to here): completions add it unless told not to, chat (whose template
    carries its own) only when told to."""
    from conftest import in_process_server

    tok = reference_llm.engine.tokenizer
    monkeypatch.setattr(tok, "_add_bos", True)
    bos = tok.bos_token_id
    with in_process_server(reference_llm.engine) as (base, _):
        def ask(path, **kw):
            body = httpx.post(base + path, timeout=60, json={"max_tokens": 1, "temperature": 0, **kw}).json()
            return body["usage"]["prompt_tokens"]

        n = len(tok.encode(PROMPT, add_special_tokens=False))
        assert ask("/v1/completions", prompt=PROMPT) == n + 1
        assert ask("/v1/completions", prompt=PROMPT, add_special_tokens=False) == n
        chat = ask("/v1/chat/completions", messages=CHAT)
        assert ask("/v1/chat/completions", messages=CHAT, add_special_tokens=True) == chat + 1
        assert reference_llm.engine.prepare_request(PROMPT, add_special_tokens=True).prompt_token_ids[0] == bos
