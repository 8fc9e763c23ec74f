"""Decode bursts (engine/burst.py): several captured decode steps run back to
back from C (greedy rows take the argmax, sampled ones a draw in C) give
every request the tokens single steps give it, end each request where single
steps end it, and hand every page back."""
import gc

import httpx
import pytest
import torch
from conftest import in_process_server
from test_captured_step import needs_c

from qoqserve.config import EngineConfig
from qoqserve.engine import burst
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.llm_engine import LLMEngine
from qoqserve.engine.scheduler import ScheduledBatch
from qoqserve.engine.sequence import Sequence
from qoqserve.kernels.cpu import decode_advance
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

pytestmark = needs_c


def test_advance_feeds_each_rows_token_back_as_its_next_input():
    g = torch.Generator().manual_seed(0)
    rows, width, bs, pad, steps = 5, 4, 16, 9999, 3
    tables = torch.randint(0, 100, (rows + 2, width), generator=g)  # more rows than advanced
    positions = torch.tensor([0, 14, 15, 47, 63, 7, 7])  # the last row's next position is past its table
    ids, lens = torch.randint(0, 50, (rows + 2,), generator=g), positions + 1
    slots = torch.full((rows + 2,), -1)
    history, step = torch.full((steps, rows), -1), torch.tensor([1])
    chosen = torch.randint(0, 50, (rows,), generator=g)
    before = (ids.clone(), positions.clone(), lens.clone(), slots.clone())
    decode_advance.advance(chosen, ids, positions, lens, slots, tables, bs, pad, history, step)
    want_pos = before[1][:rows] + 1
    assert torch.equal(ids[:rows], chosen) and torch.equal(history[1], chosen)
    assert (history[0] == -1).all() and (history[2] == -1).all() and step.item() == 2
    assert torch.equal(positions[:rows], want_pos) and torch.equal(lens[:rows], want_pos + 1)
    want_slots = [int(tables[i, p // bs]) * bs + p % bs if p // bs < width else pad
                  for i, p in enumerate(want_pos.tolist())]
    assert slots[:rows].tolist() == want_slots and want_slots[-1] == pad
    for got, was in zip((ids, positions, lens, slots), before):
        assert torch.equal(got[rows:], was[rows:])  # rows past len(chosen) untouched
    step.fill_(steps)
    with pytest.raises(RuntimeError, match="history is full"):
        decode_advance.advance(chosen, ids, positions, lens, slots, tables, bs, pad, history, step)


def _seq(n_prompt, **params):
    return Sequence("r", list(range(n_prompt)), SamplingParams(temperature=0.0, **params))


def test_a_burst_runs_only_where_it_cannot_change_a_request():
    seqs = [_seq(10, max_tokens=50), _seq(30, max_tokens=50)]
    decodes = ScheduledBatch(seqs)
    assert burst.burst_length(decodes, False, 8, 1000, 0.001) == 8
    assert burst.burst_length(decodes, False, 8, 1000, 0.004) == int(burst.BURST_SECONDS / 0.004)
    assert burst.burst_length(decodes, False, 8, 1000, None) == 1  # no step timed yet
    # a 13 ms step (batch 32 here): single steps for streams, bursts offline
    assert burst.burst_length(decodes, False, 8, 1000, 0.013) == 1
    assert burst.burst_length(decodes, False, 8, 1000, 0.013, burst.OFFLINE_BURST_SECONDS) == 8
    assert burst.burst_length(decodes, True, 8, 1000, 0.001) == 1  # a request waits
    assert burst.burst_length(decodes, False, 1, 1000, 0.001) == 1
    assert burst.burst_length(ScheduledBatch(seqs[:1], [(seqs[1], 5)]), False, 8, 1000, 0.001) == 1
    assert burst.burst_length(decodes, False, 8, 33, 0.001) == 3  # the context window: 30 + 3 tokens
    seqs[0].token_ids += [1] * 47  # 47 of 50 tokens out
    assert burst.burst_length(decodes, False, 8, 1000, 0.001) == 3
    for other in (dict(presence_penalty=0.5, logprobs=True), dict(logit_bias={t: 1.0 for t in range(513)}),
                  dict(bad_words=["x"]), dict(allowed_token_ids=[1, 2]), dict(min_tokens=5, logprobs=True)):
        x = Sequence("x", [1, 2], SamplingParams(**{"temperature": 0.0, **other}), bad_words_ids=((3,),) * (
            "bad_words" in other), stop_bans=(0,) * ("min_tokens" in other))
        assert burst.burst_length(ScheduledBatch([seqs[1], x]), False, 8, 1000, 0.001) == 1, other
    banning = Sequence("x", [1, 2], SamplingParams(temperature=0.0, min_tokens=5, max_tokens=50), stop_bans=(0, 2))
    assert burst.burst_length(ScheduledBatch([seqs[1], banning]), False, 8, 1000, 0.001) == 8
    for fits in (dict(logprobs=True, top_logprobs=2), dict(presence_penalty=0.5, repetition_penalty=1.2),
                 dict(temperature=0.7, logit_bias={3: 1.0})):
        x = Sequence("x", [1, 2], SamplingParams(**{"temperature": 0.0, "max_tokens": 50, **fits}))
        assert burst.burst_length(ScheduledBatch([seqs[1], x]), False, 8, 1000, 0.001) == 8, fits
    sampled = Sequence("x", [1, 2], SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, max_tokens=50))
    assert burst.burst_length(ScheduledBatch([seqs[0], sampled]), False, 8, 1000, 0.001) == 3  # seqs[0]'s cap


def test_the_pages_of_a_burst_are_taken_all_or_none():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a, b = _seq(6), _seq(3)
    bm.allocate(a), bm.allocate(b)  # 2 + 1 pages
    assert bm.num_free_blocks == 2
    # 6 ahead: a's slots up to 11 (1 more page), b's up to 8 (2 more): 3 > 2
    assert not bm.reserve([a, b], 6)
    assert bm.num_free_blocks == 2 and len(a.block_table) == 2 and len(b.block_table) == 1
    assert bm.reserve([a, b], 2)  # slots up to 7 (a has them) and 4: one page for b
    assert len(a.block_table) == 2 and len(b.block_table) == 2 and bm.num_free_blocks == 1
    assert bm.reserve([a, b], 5)  # up to 10 and 7: one more for a
    assert len(a.block_table) == 3 and len(b.block_table) == 2 and bm.num_free_blocks == 0


def _generate(model, prompts, params, steps, **kw):
    llm = LLM(model, kv_cache_gb=0.1, dtype="float32", num_scheduler_steps=steps, **kw)
    assert llm.engine.burst_seconds == burst.OFFLINE_BURST_SECONDS  # no stream waits on its tokens
    outs = llm.generate(prompts, params)
    engine = llm.engine
    result = ([(o.token_ids, o.text, o.finish_reason, o.logprobs, o.top_logprobs) for o in outs],
              engine.stats()["decode_bursts"])
    free = engine.block_manager.num_free_blocks == engine.runner.num_blocks
    del llm, engine
    gc.collect()
    return result, free


@pytest.fixture
def long_bursts(monkeypatch):
    monkeypatch.setattr(burst, "BURST_SECONDS", 60.0)  # the step's time never caps a burst here


def test_bursts_give_each_request_the_tokens_single_steps_give_it(qoq_tiny, long_bursts):
    prompts = [[(3 + 5 * i + j) % 250 + 3 for j in range(9 + 13 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 5, 8, 19, 40)]
    single, free = _generate(qoq_tiny, prompts, params, 1)
    assert free and single[1] == 0
    (outs, bursts), free = _generate(qoq_tiny, prompts, params, 8)
    assert outs == single[0] and bursts > 0 and free
    # a stop token the single steps met in the middle of a burst, and a
    # stop string, end the request at the same token
    tokens, text = single[0][4][:2]
    stops = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[tokens[13]]),
             SamplingParams(temperature=0.0, max_tokens=40, stop=[text[len(text) // 2:][:3]])]
    single, _ = _generate(qoq_tiny, [prompts[4]] * 2, stops, 1)
    (outs, bursts), free = _generate(qoq_tiny, [prompts[4]] * 2, stops, 8)
    assert [o[2] for o in single[0]] == ["stop", "stop"] and len(single[0][0][0]) == 14
    assert outs == single[0] and bursts > 0 and free


def test_logprobs_in_bursts_are_those_of_single_steps(qoq_tiny, long_bursts):
    """A burst records each step's logprobs after the draw (logprob_step): the
    same values, bit for bit, as single steps give."""
    prompts = [[7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.9, seed=4, max_tokens=18, ignore_eos=True, logprobs=True)]
    single, _ = _generate(qoq_tiny, prompts, params, 1)
    (outs, bursts), free = _generate(qoq_tiny, prompts, params, 8)
    assert outs == single[0] and bursts > 0 and free
    assert len(outs[1][3]) == 15 and [len(t) for t in outs[1][4]] == [3] * 15 and outs[2][4] is None


def test_penalties_in_bursts_give_the_tokens_of_single_steps(qoq_tiny, long_bursts):
    """A burst applies each step's penalties (penalize_step, its state brought
    up to date with the burst's own tokens) before the argmax or the draw:
    the tokens single steps give, penalized greedy and sampled rows beside
    plain ones, and stop tokens banned until min_tokens; penalties with
    logprobs still run single steps."""
    prompts = [[7, 8, 9, 10], [11, 12, 13, 11, 12, 13], [20, 21, 22, 23], [5, 5, 6]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=1.0,
                             frequency_penalty=0.7, logit_bias={30: 2.0, 31: -5.0}),
              SamplingParams(temperature=0.8, seed=9, max_tokens=22, ignore_eos=True, repetition_penalty=0.8,
                             frequency_penalty=-0.5),
              SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)]
    single, _ = _generate(qoq_tiny, prompts, params, 1)
    plain, _ = _generate(qoq_tiny, prompts[:1], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)], 1)
    assert single[0][0][0] != plain[0][0][0]  # the penalty changes the tokens: the test sees it applied
    (outs, bursts), free = _generate(qoq_tiny, prompts, params, 8)
    assert outs == single[0] and bursts > 0 and free
    # min_tokens: the end-of-text token, forced by a bias, banned until then, in bursts as in single steps
    eos = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32").engine.tokenizer.eos_token_ids[0]
    gc.collect()
    forced = [SamplingParams(temperature=0.0, max_tokens=30, min_tokens=m, logit_bias={eos: 50.0}) for m in (13, 3)]
    single, _ = _generate(qoq_tiny, prompts[:2], forced, 1)
    (outs, bursts), _ = _generate(qoq_tiny, prompts[:2], forced, 8)
    assert [len(o[0]) for o in single[0]] == [14, 4] and [o[2] for o in single[0]] == ["stop", "stop"]
    assert outs == single[0] and bursts > 0
    both = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3, logprobs=True)]
    single, _ = _generate(qoq_tiny, prompts[1:2], both, 1)
    (outs, bursts), _ = _generate(qoq_tiny, prompts[1:2], both, 8)
    assert outs == single[0] and bursts == 0


def test_a_burst_that_fails_runs_as_a_single_step(qoq_tiny, long_bursts, monkeypatch):
    prompts, params = [[7, 8, 9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    single, _ = _generate(qoq_tiny, prompts, params, 1)

    def fails(self, batch, n):
        raise RuntimeError("CPU kernel decode_advance failed during a replayed step")
    monkeypatch.setattr("qoqserve.engine.model_runner.ModelRunner.run_burst", fails)
    (outs, bursts), free = _generate(qoq_tiny, prompts, params, 8)
    assert outs == single[0] and bursts == 0 and free


def test_a_stream_served_in_bursts_is_the_answer_of_single_steps(qoq_tiny, long_bursts):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    llm = LLM(qoq_tiny, kv_cache_gb=0.1, dtype="float32", num_scheduler_steps=1)
    want = llm.generate([body["prompt"]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    del llm
    gc.collect()
    engine = LLMEngine(EngineConfig.from_kwargs(qoq_tiny, kv_cache_gb=0.1, dtype="float32",
                                                num_scheduler_steps=8))  # as `serve` makes it
    assert engine.burst_seconds == burst.BURST_SECONDS  # the streaming budget (patched long here)
    with in_process_server(engine) as (base, _):
        full = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        chunks = []
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(httpx.Response(200, content=line[6:]).json())
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert full["choices"][0]["text"] == text == want.text
    assert full["usage"]["completion_tokens"] == len(want.token_ids) == 30
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert engine.stats()["decode_bursts"] >= 2
    assert len([c for c in chunks if c["choices"]]) < 30  # tokens arrived several to a chunk


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
           SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=5, max_tokens=30, ignore_eos=True)]


def test_seeded_sampled_requests_draw_the_same_tokens_in_bursts(qoq_tiny, long_bursts):
    prompts = [[9, 8, 7, 6, 5], [4, 5, 6], [20, 21, 22, 23, 24, 25, 26]]
    single, _ = _generate(qoq_tiny, prompts, SAMPLED, 1)
    (outs, bursts), free = _generate(qoq_tiny, prompts, SAMPLED, 8)
    assert outs == single[0] and bursts > 0 and free
    assert len(set(single[0][0][0])) > 3  # really sampled, not stuck on one token
    alone, _ = _generate(qoq_tiny, prompts[2:], SAMPLED[2:], 8)  # and whoever shares the burst
    assert alone[0][0] == single[0][2]


def test_a_sampled_burst_that_does_not_run_gives_its_draws_back(qoq_tiny, long_bursts, monkeypatch):
    from qoqserve.engine.captured_burst import CapturedBursts
    prompts = [[9, 8, 7, 6, 5]]
    single, _ = _generate(qoq_tiny, prompts, SAMPLED[:1], 1)

    def draws_then_fails(self, decodes, n, draw=None, top_k=None, penalized=False):
        if draw is not None:
            draw(n)  # the uniforms are taken, then the replay fails
        raise RuntimeError("CPU kernel sample_step failed during a replayed step")
    monkeypatch.setattr(CapturedBursts, "run", draws_then_fails)
    (outs, bursts), free = _generate(qoq_tiny, prompts, SAMPLED[:1], 8)
    assert outs == single[0] and bursts == 0 and free


def test_plans_with_and_without_logprobs_share_their_buffers(qoq_tiny, long_bursts):
    """A sampled burst plan records the addresses of its draw buffers; a later
    plan of the same row count (the same draws, with logprobs) must not
    replace them, or the first plan's next replay reads freed memory."""
    prompt, base = [[9, 8, 7, 6, 5]], SAMPLED[0]
    with_lp = SamplingParams(**{**base.__dict__, "logprobs": True, "top_logprobs": 2})
    single = [_generate(qoq_tiny, prompt, p, 1)[0][0] for p in (base, with_lp)]
    llm = LLM(qoq_tiny, kv_cache_gb=0.1, dtype="float32", num_scheduler_steps=8)
    for p, want in ((base, single[0]), (with_lp, single[1]), (base, single[0]), (with_lp, single[1])):
        got = [(o.token_ids, o.text, o.finish_reason, o.logprobs, o.top_logprobs) for o in llm.generate(prompt, p)]
        assert got == want
    bursts = llm.engine.runner.captured.bursts
    assert len({id(b) for key, b in bursts.plans.items() if key[0] == 1}) == 2
    assert llm.engine.stats()["decode_bursts"] > 0
