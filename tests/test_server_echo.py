"""/v1/completions with echo and logprobs: the prompt's own token logprobs
(the request lm-eval-harness sends for log-likelihoods: token-id prompts in a
list, echo, logprobs, max_tokens 0 or 1)."""
from __future__ import annotations

import json

import httpx
import pytest

KEY = {"Authorization": "Bearer test-key"}
PROMPT = "The three primary colors are red, yellow and blue."


def complete(server, **body) -> dict:
    r = httpx.post(server.base + "/v1/completions", json=body, headers=KEY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_scoring_a_prompt_gives_the_engines_prompt_logprobs(server, reference_llm):
    eng = reference_llm.engine
    ids = eng.tokenizer.encode(PROMPT)
    got = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    (c,) = got["choices"]
    lp = c["logprobs"]
    assert c["text"] == PROMPT and c["finish_reason"] == "length" and got["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [eng.tokenizer.token_to_str(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    chosen, tops, _ = eng.prompt_token_logprobs(ids, 3)
    assert lp["token_logprobs"][1:] == pytest.approx(chosen, abs=1e-4)
    for top, ref in zip(lp["top_logprobs"][1:], tops):
        assert list(top) == [eng.tokenizer.token_to_str(t) for t, _ in ref]
        assert max(top.values()) >= lp["token_logprobs"][lp["top_logprobs"].index(top)] - 1e-4


def test_a_scored_continuation_matches_the_logprobs_it_was_generated_with(server):
    gen = complete(server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)["choices"][0]
    scored = complete(server, prompt=PROMPT + gen["text"], max_tokens=0, echo=True, logprobs=1)["choices"][0]
    n = len(gen["logprobs"]["tokens"])
    assert scored["logprobs"]["tokens"][-n:] == gen["logprobs"]["tokens"]
    assert scored["logprobs"]["token_logprobs"][-n:] == pytest.approx(gen["logprobs"]["token_logprobs"], abs=1e-3)


def test_echo_logprobs_then_generated_ones_streamed_or_not(server):
    body = dict(prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2)
    full = complete(server, **body)["choices"][0]
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}, headers=KEY,
                      timeout=120) as r:
        chunks = [json.loads(ln[6:])["choices"][0] for ln in r.iter_lines() if ln.startswith("data: {")]
    joined = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in full["logprobs"]}
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert joined == full["logprobs"]
    offsets, text = full["logprobs"]["text_offset"], full["text"]
    assert [text[o:o + len(t)] for o, t in zip(offsets, full["logprobs"]["tokens"])] == full["logprobs"]["tokens"]


def test_lm_eval_shape_token_prompts_in_a_list(server, reference_llm):
    eng = reference_llm.engine
    prompts = [eng.tokenizer.encode(p) for p in ("Water boils at 100 degrees.", "Paris is in France.")]
    got = complete(server, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0)
    for c, ids in zip(got["choices"], prompts):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(eng.prompt_token_logprobs(ids)[0], abs=1e-4)


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_prompt_logprobs_give_each_prompt_tokens_logprob_rank_and_top(server, reference_llm, path):
    eng = reference_llm.engine
    chat = path.endswith("chat/completions")
    body = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    r = httpx.post(server.base + path, json={**body, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
                   headers=KEY, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    plp = got["prompt_logprobs"] if chat else got["choices"][0]["prompt_logprobs"]
    ids = httpx.post(server.base + "/tokenize", json=body, timeout=60).json()["tokens"]
    chosen, tops, ranks = eng.prompt_token_logprobs(ids, 2)
    assert len(plp) == len(ids) == got["usage"]["prompt_tokens"] and plp[0] is None
    for at, tok in enumerate(ids[1:]):
        entries = plp[at + 1]
        own = entries[str(tok)]
        assert own["logprob"] == pytest.approx(chosen[at], abs=1e-4) and own["rank"] == ranks[at]
        assert own["decoded_token"] == eng.tokenizer.token_to_str(tok)
        best = [t for t, _ in tops[at]]
        assert [entries[str(t)]["rank"] for t in best] == [1, 2]
        assert len(entries) == 2 + (tok not in best)
    assert any(e["rank"] > 2 for e in plp[1:] for e in e.values())  # some prompt tokens are not the top


def test_prompt_logprobs_are_refused_in_a_stream(server):
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "prompt_logprobs": 1, "stream": True},
                   headers=KEY, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_logprobs_and_prompt_logprobs_together_each_keep_their_own_top(server):
    got = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, prompt_logprobs=3)["choices"][0]
    tops, ranked = got["logprobs"]["top_logprobs"], got["prompt_logprobs"]
    assert tops[0] is None and ranked[0] is None and len(tops) == len(ranked)
    assert all(len(t) == 1 for t in tops[1:])
    assert all(3 <= len(r) <= 4 and sorted(e["rank"] for e in r.values())[:3] == [1, 2, 3] for r in ranked[1:])
    for t, r, lp in zip(tops[1:], ranked[1:], got["logprobs"]["token_logprobs"][1:]):
        (best,) = t.values()
        assert best == pytest.approx(next(e["logprob"] for e in r.values() if e["rank"] == 1))
        assert any(e["logprob"] == pytest.approx(lp) for e in r.values())
