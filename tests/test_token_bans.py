"""vLLM's allowed_token_ids, bad_words, min_tokens (its stop tokens banned
until then) and truncate_prompt_tokens: in the sampler on random logits
against a masked reference, in the engine on the embedded model against
its own unbanned greedy output, and over HTTP."""
from __future__ import annotations

import httpx
import pytest
import torch

from qoqserve.engine.sequence import Sequence
from qoqserve.errors import InvalidRequestError
from qoqserve.layers.sampler import Sampler
from qoqserve.layers.token_bans import banned_tokens
from qoqserve.sampling_params import InvalidSamplingParams, SamplingParams

PROMPT = "The three primary colors are"


def test_bad_word_runs_ban_their_last_token_after_their_prefix():
    p = SamplingParams(temperature=0)
    seq = Sequence("a", [9, 9, 5, 6], p, num_prompt_tokens=2, bad_words_ids=((7,), (5, 6, 8), (6, 3), (9, 5)))
    # (7,) always; (5, 6, 8): the output ends with 5, 6; (6, 3): ends with 6;
    # (9, 5): its prefix 9 is in the prompt only, which bad words do not look at
    assert sorted(banned_tokens(seq)) == [3, 7, 8]
    seq.token_ids.append(1)
    assert banned_tokens(seq) == [7]


def test_stop_tokens_are_banned_until_min_tokens_are_out():
    seq = Sequence("a", [1, 2], SamplingParams(temperature=0, min_tokens=2), stop_bans=(0, 4))
    assert seq.bans_tokens and banned_tokens(seq) == [0, 4]
    seq.token_ids.append(3)
    assert banned_tokens(seq) == [0, 4]
    seq.token_ids.append(3)
    assert not seq.bans_tokens and banned_tokens(seq) == []


def test_sampler_picks_only_what_is_left_and_logprobs_stay_the_models():
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    allowed = [5, 17, 123, 299]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=True),
              SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed, logprobs=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=True)]
    seqs = [Sequence(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]
    top1 = int(logits[3].argmax())
    seqs[3].bad_words_ids = ((top1,),)
    toks, lps, _ = Sampler()(logits.clone(), seqs)
    masked = torch.full_like(logits[0], float("-inf"))
    masked[allowed] = logits[0, allowed]
    assert toks[0] == int(masked.argmax())
    assert toks[1] == int(logits[1].argmax())  # a row without bans is untouched
    assert toks[2] in allowed
    ref = logits[3].clone()
    ref[[1, 2, 3]] = torch.where(ref[[1, 2, 3]] > 0, ref[[1, 2, 3]] / 1.3, ref[[1, 2, 3]] * 1.3)
    ref[top1] = float("-inf")
    assert toks[3] == int(ref.argmax()) != top1
    model = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([float(model[i, t]) for i, t in enumerate(toks)], rel=1e-6)


def test_sampled_rows_never_draw_a_banned_token():
    logits = torch.zeros(1, 50)  # uniform: any token could come
    seq = Sequence("s", [1], SamplingParams(temperature=1.0, seed=0, allowed_token_ids=list(range(10))),
                   bad_words_ids=((3,), (4,)))
    s = Sampler()
    drawn = {s(logits.clone(), [seq])[0][0] for _ in range(200)}
    assert drawn == set(range(10)) - {3, 4}


@pytest.mark.parametrize("kwargs", [dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
                                    dict(allowed_token_ids=[1.5]), dict(allowed_token_ids=3),
                                    dict(bad_words=["  "]), dict(bad_words="blue"), dict(bad_words=[3]),
                                    dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2)])
def test_invalid_fields_are_refused_naming_them(kwargs):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs))


@pytest.fixture(scope="module")
def llm(reference_llm):
    return reference_llm


def greedy(llm, prompt=PROMPT, **kw):
    return llm.generate(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 24, **kw}))[0]


def test_bad_words_never_appear_and_change_nothing_before(llm):
    plain = greedy(llm)
    runs = llm.engine.admission.bad_words_ids(["blue", "RGB color"])
    ends = [i for i in range(len(plain.token_ids))
            if any(tuple(plain.token_ids[max(0, i + 1 - len(r)):i + 1]) == r for r in runs)]
    assert ends  # the plain output holds them: the test bans something
    out = greedy(llm, bad_words=["blue", "RGB color"])
    ids = out.token_ids
    for run in runs:
        assert not any(tuple(ids[i:i + len(run)]) == run for i in range(len(ids)))
    # up to the first token the ban takes out, the output is the plain one
    first = ends[0]
    assert ids[:first] == plain.token_ids[:first] and ids[first] != plain.token_ids[first]


def test_allowed_token_ids_keep_the_output_when_they_hold_it_and_bound_it_when_not(llm):
    plain = greedy(llm, logprobs=True)
    same = greedy(llm, logprobs=True, allowed_token_ids=sorted(set(plain.token_ids)) + [7, 300])
    assert same.token_ids == plain.token_ids
    assert same.logprobs == pytest.approx(plain.logprobs, rel=1e-6)  # the model's, not the masked ones
    allowed = [t for t in range(200, 3000) if t != plain.token_ids[0]]
    bound = greedy(llm, allowed_token_ids=allowed)
    assert set(bound.token_ids) <= set(allowed) and bound.token_ids[0] != plain.token_ids[0]


def test_min_tokens_keep_the_model_from_ending_before(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    plain = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60))[0]
    assert plain.finish_reason == "stop"
    n = len(plain.token_ids) + 4
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60, min_tokens=n))[0]
    eos = set(llm.engine.tokenizer.eos_token_ids)
    assert len(longer.token_ids) >= n and not eos & set(longer.token_ids[:n])
    assert longer.token_ids[:len(plain.token_ids) - 1] == plain.token_ids[:-1]  # the same until its EOS


def test_banned_requests_do_not_change_the_others_in_their_batch(llm):
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=16, bad_words=["blue"], min_tokens=16),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16)]
    prompts = [PROMPT, PROMPT, "Once upon a time"]
    together = llm.generate(prompts, params)
    for i in (0, 2):
        assert together[i].token_ids == llm.generate(prompts[i], params[i])[0].token_ids


def test_nothing_left_to_pick_ends_only_that_request(llm):
    eos = llm.engine.tokenizer.eos_token_ids[0]
    engine = llm.engine
    engine.add_request("dead", PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                      allowed_token_ids=[eos]))
    engine.add_request("alive", PROMPT, SamplingParams(temperature=0, max_tokens=8))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["dead"].finish_reason == "error" and done["dead"].error_code == "no_token_allowed"
    assert done["alive"].token_ids == greedy(llm, max_tokens=8).token_ids


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    ids = llm.engine.tokenizer.encode(PROMPT)
    out = greedy(llm, truncate_prompt_tokens=3, max_tokens=8)
    assert out.prompt_token_ids == ids[-3:]
    assert out.token_ids == greedy(llm, ids[-3:], max_tokens=8).token_ids
    assert greedy(llm, truncate_prompt_tokens=-1, max_tokens=8).prompt_token_ids == ids
    with pytest.raises(InvalidRequestError) as e:
        greedy(llm, truncate_prompt_tokens=10_000)
    assert e.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError) as e:
        greedy(llm, allowed_token_ids=[10**6])
    assert e.value.param == "allowed_token_ids"


def test_the_fields_over_http_as_offline(server, reference_llm):
    def ask(**kw):
        r = httpx.post(server.base + "/v1/completions", timeout=60, headers={"Authorization": "Bearer test-key"},
                       json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw})
        return r.status_code, r.json()

    fields = dict(bad_words=["blue"], allowed_token_ids=list(range(200, 6000)), min_tokens=12)
    code, body = ask(**fields)
    ref = greedy(reference_llm, max_tokens=12, **fields)
    assert code == 200 and body["choices"][0]["text"] == ref.text
    code, body = ask(truncate_prompt_tokens=2, echo=True)
    ids = reference_llm.engine.tokenizer.encode(PROMPT)[-2:]
    assert body["usage"]["prompt_tokens"] == 2
    assert body["choices"][0]["text"] == (reference_llm.engine.tokenizer.decode(ids)
                                          + greedy(reference_llm, ids, max_tokens=12).text)
    chat = httpx.post(server.base + "/v1/chat/completions", timeout=60, headers={"Authorization": "Bearer test-key"},
                      json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                            "truncate_prompt_tokens": 5, "prompt_logprobs": 0}).json()
    assert chat["usage"]["prompt_tokens"] == 5 and len(chat["prompt_logprobs"]) == 5
    for bad in (dict(allowed_token_ids=[10**6]), dict(bad_words=[" "]), dict(truncate_prompt_tokens=0),
                dict(allowed_token_ids=[])):
        code, body = ask(**bad)
        assert code == 400 and body["error"]["param"] == next(iter(bad)), (bad, body)
    code, body = ask(allowed_token_ids=reference_llm.engine.tokenizer.eos_token_ids[:1], min_tokens=3)
    assert code == 400 and body["error"]["code"] == "no_token_allowed"
