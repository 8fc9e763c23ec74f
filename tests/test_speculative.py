"""Speculative decoding with n-gram drafts (engine/speculative.py): every
request gets, token for token, what it gets without it (greedy, seeded drawn
and penalized ones through the drafts, the others beside them in the same steps), drafts are proposed
and accepted where the context repeats, nothing outlives the requests, and a
bad --speculative-config stops the start naming what is wrong."""
from __future__ import annotations

import gc
import json

import pytest

from qoqserve.config import SpeculativeConfig
from qoqserve.engine import speculative
from qoqserve.engine.ngram_proposer import NgramIndex
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump. The five boxing wizards jump quickly.")
COPY = [f"Repeat this text exactly, word for word:\n\n{TEXT}\n\nRepeated:\n\n",
        f"{TEXT} {TEXT} {TEXT[:40]}",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"]


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    ix = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert ix.propose(tokens, 4) == [4, 5, 1, 2]  # (1, 2, 3) ended at 3 before
    assert ix.propose(tokens, 2) == [4, 5]
    tokens.append(9)
    assert ix.propose(tokens, 4) == []  # 9 never came before: its own end does not count
    tokens += [1, 2]
    assert ix.propose(tokens, 3) == [3, 9, 1]  # (1, 2): the latest of its two earlier ends
    assert ix.propose(tokens, 0) == []
    assert NgramIndex(2, 2).propose([7, 7], 3) == []  # the suffix is the whole sequence
    assert NgramIndex(1, 1).propose([7, 7], 3) == [7]  # runs past the end: what there is
    # longest first: n=2 finds (5, 6) -> 8, though (6,) alone last ended before 1
    assert NgramIndex(1, 2).propose([5, 6, 8, 0, 6, 1, 5, 6], 1) == [8]


def test_speculative_config_takes_vllms_form_and_names_what_is_wrong():
    assert SpeculativeConfig.parse(None) is None
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    for bad, says in (("{", "not JSON"), ("[1]", "JSON object"), ({"num_speculative_tokens": 0}, "num_speculative"),
                      ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"), ({}, "required"),
                      ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "> prompt"),
                      ({"num_speculative_tokens": 2, "draft": 1}, "unknown keys")):
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="eagle"):
        LLM(None, kv_cache_gb=0.02, max_num_seqs=2, speculative_config={"method": "eagle",
                                                                        "num_speculative_tokens": 2})


def _outputs(llm, prompts, params):
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished()
    assert not llm.engine.speculator or not llm.engine.speculator._drafting
    return [(o.token_ids, o.finish_reason, o.logprobs, o.error_code) for o in outs]


def _with_and_without_drafts(run, model, **kw):
    """run(llm) on an engine without drafts, then on one with them (one engine
    at a time): (plain result, drafted result, the drafted engine's stats)."""
    out = []
    for spec in (None, SPEC):
        llm = LLM(model, kv_cache_gb=0.05, speculative_config=spec, **kw)
        out.append(run(llm))
        stats = llm.engine.stats()
        del llm
        gc.collect()
    return out[0], out[1], stats


def _mixed_params(n_greedy: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy requests (drafted) and, beside them in the same steps, one of each kind that is not."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=max_tokens + i, ignore_eos=True) for i in range(n_greedy)]
    return greedy + [SamplingParams(temperature=0.8, seed=7, max_tokens=max_tokens, ignore_eos=True),
                     SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, max_tokens=max_tokens),
                     SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=max_tokens)]


MODELS = {"fp32, captured": (None, {}), "fp32, eager": (None, {"enforce_eager": True}),
          "w4a8kv4, captured": ("qoq", {})}
# the tiny random model's own loops give drafts, but how many it accepts
# depends on its checkpoint (quantized on the host): the oracle test below
# makes W4A8KV4 accept and reject drafts on any host


@pytest.mark.parametrize("case", list(MODELS))
def test_speculative_outputs_are_the_plain_outputs_token_for_token(case, qoq_tiny):
    model, kw = MODELS[case]
    if model == "qoq":
        model = qoq_tiny
        # a tiny random model: prompts that repeat, so its greedy text loops and drafts hit
        prompts = [[5 + (i % 7) * 3 for i in range(40)], [9, 8, 7, 6] * 8, [100 + i for i in range(30)]]
    else:
        prompts = COPY
    n = len(prompts)
    params = _mixed_params(n, 40)
    prompts = prompts + prompts[:3]
    plain, drafted, stats = _with_and_without_drafts(lambda llm: _outputs(llm, prompts, params), model,
                                                     max_num_seqs=8, **kw)
    assert drafted == plain
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert model == qoq_tiny or stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]


REPEATS = ["one one one one one one one one one one one one one one one one one one",
           "Say it again: yes yes yes yes yes yes yes yes yes yes yes yes yes yes"]


def seeded_drawn_penalized_and_logprob_requests_keep_their_tokens(model: str | None) -> None:
    """Requests drawn by temperature, min_p, top-k and top-p, with penalties and
    logit_bias, or asking logprobs get drafts too: each token after a draft is
    chosen only while the drafts before it hold (one uniform a drawn token),
    its penalties counting those drafts, its logprobs those of its own row, so
    a seeded request gets, token for token and logprob for logprob, what it
    gets without drafts; on text that repeats, their tokens accept drafts (on
    REPEATS, penalties that leave the drafts out choose other tokens). The
    W4A8KV4 case runs in tests/test_qoq_embedded.py, beside the checkpoint it
    quantizes."""
    drawn = [SamplingParams(temperature=0.3, seed=1, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0.5, top_k=5, min_p=0.05, seed=3, max_tokens=36, ignore_eos=True)]
    penalized = [SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=30, ignore_eos=True),
                 SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=24, ignore_eos=True),
                 SamplingParams(temperature=0.6, seed=5, frequency_penalty=0.3, max_tokens=24, ignore_eos=True),
                 SamplingParams(temperature=0.4, seed=4, presence_penalty=0.2, frequency_penalty=0.3,
                                logit_bias={13: 2.0}, max_tokens=24, ignore_eos=True)]
    asking = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=6, logprobs=True, max_tokens=30, ignore_eos=True)]
    # each penalized kind alone on REPEATS: room in every step for its drafts
    plain, drafted, stats = _with_and_without_drafts(
        lambda llm: ([_outputs(llm, COPY, drawn), _outputs(llm, COPY[:2], asking)]
                     + [_outputs(llm, REPEATS, q) for q in penalized]), model, max_num_seqs=4)
    assert drafted == plain
    assert stats["spec_decode_num_accepted_tokens"] > 8, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats


def test_seeded_drawn_penalized_and_logprob_requests_verify_drafts_and_get_their_plain_tokens():
    seeded_drawn_penalized_and_logprob_requests_keep_their_tokens(None)


def test_drafts_stop_at_max_tokens_and_stops_and_fit_the_captured_sizes():
    """max_tokens and stop strings end a request where they would without
    drafts; with max_num_seqs 2 the largest captured step has 2 rows, so a
    single request verifies one draft at a time, two none."""
    plain = LLM(None, kv_cache_gb=0.05, max_num_seqs=2)
    spec = LLM(None, kv_cache_gb=0.05, max_num_seqs=2, speculative_config=SPEC)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 13)]
    params.append(SamplingParams(temperature=0.0, max_tokens=60, stop=["lazy"]))
    for p in params:
        want = _outputs(plain, [COPY[1]], p)
        assert _outputs(spec, [COPY[1]], p) == want, p
        assert p.stop or len(want[0][0]) == p.max_tokens
    assert spec.engine.speculator.num_accepted_tokens > 0
    assert _outputs(spec, COPY[:2], params[3]) == _outputs(plain, COPY[:2], params[3])


def test_a_request_that_fails_in_a_speculative_step_ends_alone():
    """A request with nothing left to pick (EOS, its only allowed token, banned
    until min_tokens) fails the step the drafts ran in: the step runs again
    plainly, that request ends with its error, the rest get their outputs."""
    plain = LLM(None, kv_cache_gb=0.05, max_num_seqs=4)
    spec = LLM(None, kv_cache_gb=0.05, max_num_seqs=4, speculative_config=SPEC)
    eos = plain.engine.tokenizer.eos_token_ids[0]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True) for _ in COPY[:2]]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=[eos], min_tokens=3))
    prompts = COPY[:2] + [COPY[2]]
    got, want = _outputs(spec, prompts, params), _outputs(plain, prompts, params)
    assert got == want
    assert got[2][1] == "error" and got[2][3] == "no_token_allowed" and got[0][1] == "length"
    assert spec.engine.speculator.num_accepted_tokens > 0


def test_a_request_whose_drafts_fail_stops_drafting_for_a_while():
    state = speculative.Drafting(1, 2)
    tokens = [1, 2, 3, 1, 2]
    assert state.propose(tokens, 2) == [3, 1]
    state.verified(2, 0)
    state.verified(2, 0)  # rate 0.25: below MIN_RATE
    assert state.rate < speculative.MIN_RATE
    skipped = 0
    while not state.propose(tokens, 2):
        skipped += 1
    steps = (speculative.MIN_RATE - 0.25) / speculative.RECOVER  # to climb back (and one for rounding)
    assert round(steps) <= skipped <= round(steps) + 1
    state.verified(2, 2)
    assert state.rate > speculative.MIN_RATE


def test_the_embedded_model_copying_its_prompt_verifies_drafts_by_its_own_choice():
    """No forcing: on the real model at batch 1 the step times make the drafts
    of a text that repeats worth verifying, and the output is the plain one."""
    plain = LLM(None, kv_cache_gb=0.05, max_num_seqs=4)
    spec = LLM(None, kv_cache_gb=0.05, max_num_seqs=4, speculative_config=SPEC)
    p = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    assert _outputs(spec, [COPY[1]], p) == _outputs(plain, [COPY[1]], p)
    assert spec.engine.speculator.num_accepted_tokens > 8
    assert spec.engine.speculator.num_drafts < spec.engine.speculator.num_accepted_tokens


def test_served_with_speculative_config_streams_the_plain_answer_and_counts_drafts():
    """`serve --speculative-config`: a greedy chat stream (several tokens a
    step) is the plain engine's answer, and /metrics counts vLLM's
    spec_decode counters."""
    import httpx
    from conftest import in_process_server

    from qoqserve.config import EngineConfig
    from qoqserve.engine.llm_engine import LLMEngine

    msgs = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
    plain = LLM(None, kv_cache_gb=0.05, max_num_seqs=4)
    want = plain.chat([msgs], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    del plain
    gc.collect()
    engine = LLMEngine(EngineConfig.from_kwargs(None, kv_cache_gb=0.05, max_num_seqs=4,
                                                speculative_config=json.dumps(SPEC)))  # as the flag gives it
    body = {"model": engine.model_name, "messages": msgs, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with in_process_server(engine) as (base, _):
        chunks = []
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(httpx.Response(200, content=line[6:]).json())
        metrics = {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
                   for line in httpx.get(base + "/metrics", timeout=30).text.splitlines()
                   if line.startswith("vllm:spec_decode")}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == want.text and len(want.token_ids) == 40
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] >= metrics["vllm:spec_decode_num_accepted_tokens_total"]


def test_drafts_with_a_full_page_pool_and_prefix_hits_keep_outputs(qoq_tiny):
    """12 pages of 16 tokens for six sequences sharing a 4-page prefix: drafts
    take pages ahead (or are dropped when none are free), sequences are
    preempted and recomputed from the prefix cache, and every output is the
    one of the prompt run alone without drafts."""
    shared = [3 + (j * 11) % 200 for j in range(64)]
    prompts = [shared + [7 + i * 13 + j % 5 for j in range(10 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = LLM(qoq_tiny, kv_cache_gb=0.05, enable_prefix_caching=False)
    alone = [_outputs(ref, [p], params)[0] for p in prompts]
    del ref
    gc.collect()
    llm = LLM(qoq_tiny, num_blocks=12, max_num_batched_tokens=32, speculative_config=SPEC)
    assert _outputs(llm, prompts, params) == alone
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert stats["spec_decode_num_draft_tokens"] > 0, stats


def test_a_tensor_parallel_engine_verifies_drafts_on_every_rank():
    """-tp 2 (gloo): the draft rows go to the worker in the step's broadcast
    like any decode row; the split engine with drafts gives the whole engine's
    greedy tokens without them."""
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 42] * 5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    small = dict(num_blocks=48, max_model_len=128, enforce_eager=True, dtype="float32")
    want = _outputs(LLM("synthetic:tiny", **small), prompts, params)
    with LLM("synthetic:tiny", tensor_parallel_size=2, speculative_config=SPEC, **small) as split:
        assert _outputs(split, prompts, params) == want
        assert split.engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_oracle_drafts_are_accepted_up_to_the_first_wrong_one_in_w4a8kv4(qoq_tiny, monkeypatch):
    """Drafts that are the plain run's own next tokens with the third one
    wrong: every verify step must accept exactly the first two (and the
    token after them), on the W4A8KV4 kernels, with the plain outputs."""
    prompts = [[5 + (i % 7) * 3 for i in range(40)], [100 + i for i in range(30)]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(qoq_tiny, kv_cache_gb=0.05, max_num_seqs=8)
    want = _outputs(plain, prompts, params)
    del plain
    gc.collect()
    runs = [(p, w[0]) for p, w in zip(prompts, want)]

    lengths = []

    def oracle(self, tokens, k):
        for prompt, out in runs:
            done = len(tokens) - len(prompt)
            if tokens[:len(prompt)] == prompt and tokens[len(prompt):] == out[:done]:
                d = out[done:done + k]
                d = d[:2] + [(t + 1) % 256 for t in d[2:3]] + d[3:]  # the third wrong
                lengths.append(len(d))
                return d
        raise AssertionError("a sequence the plain run did not make")

    monkeypatch.setattr(speculative.Drafting, "propose", oracle)
    spec = LLM(qoq_tiny, kv_cache_gb=0.05, max_num_seqs=8, speculative_config=SPEC)
    assert _outputs(spec, prompts, params) == want
    s = spec.engine.speculator
    assert s.num_drafts == len([n for n in lengths if n]) > 10
    assert s.num_draft_tokens == sum(lengths) > s.num_accepted_tokens == sum(min(n, 2) for n in lengths)
