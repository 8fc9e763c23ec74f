"""A step that fails ends only the request that caused it (engine level).

The failures are injected by wrapping the runner's sampler (or the runner)
in the test: a request can no longer carry a value that breaks a step, since
admission refuses them all, so the hook stands in for the next bug.
"""
from __future__ import annotations

import pytest
from conftest import FlakyRunner, PoisonedSampler

from qoqserve.engine.isolation import StepIsolation
from qoqserve.errors import InvalidRequestError
from qoqserve.sampling_params import InvalidSamplingParams, SamplingParams

PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is",
           "The quick brown fox"]
POISON = "Tell me a story about a dragon"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(reference_llm):
    """The session's offline engine (each test leaves it idle, its hooks undone),
    one step at a time: the faults here are injected into the runner's run and
    the sampler, which a decode burst does not call (a burst that fails runs
    its step again alone: tests/test_decode_burst.py)."""
    sched = reference_llm.engine.config.scheduler
    steps, sched.num_scheduler_steps = sched.num_scheduler_steps, 1
    yield reference_llm
    sched.num_scheduler_steps = steps
    for rid in list(reference_llm.engine.trackers):  # a failed test must not leave work behind
        reference_llm.engine.abort(rid)


def poisoned(rid: str, after: int = 0):
    return lambda r: r.request_id == rid and r.num_output_tokens >= after


@pytest.fixture(scope="module")
def alone(llm):
    """Each request's tokens when it runs by itself."""
    ref = {p: llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS + [POISON]}
    ref["seeded"] = llm.generate(PROMPTS[0], SEEDED)[0].token_ids
    return ref


def run_all(engine) -> dict:
    finals, pages_checked = {}, False
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
            if out.finish_reason == "error":  # its pages are back at once, nobody else's
                bm = engine.block_manager
                held = set().union(*(s.block_table for s in engine.scheduler.running))
                assert bm.used_ids == held and bm.num_free_blocks == bm.num_blocks - len(held)
                pages_checked = True
    return finals, pages_checked


def check_all_pages_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_ids
    assert not engine.trackers and not engine.has_unfinished()


def test_a_poisoned_request_fails_alone_and_the_others_are_untouched(llm, alone, monkeypatch):
    engine = llm.engine
    sampler = PoisonedSampler(engine.runner.sampler, poisoned("bad", after=3))
    monkeypatch.setattr(engine.runner, "sampler", sampler)
    before = engine.stats()
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"ok-{i}", p, GREEDY)
    engine.add_request("seeded", PROMPTS[0], SEEDED)
    engine.add_request("bad", POISON, GREEDY)
    finals, pages_checked = run_all(engine)
    assert len(sampler.failed_batch_sizes) >= 2  # the whole step, then the culprit alone
    assert max(sampler.failed_batch_sizes) > 1  # it failed in a batch shared with the others
    for i, p in enumerate(PROMPTS):
        assert finals[f"ok-{i}"].token_ids == alone[p] and finals[f"ok-{i}"].finish_reason == "length"
    # the seeded request's generator was rolled back after the failed draws
    assert finals["seeded"].token_ids == alone["seeded"]
    bad = finals["bad"]
    assert bad.finish_reason == "error" and "injected fault for bad" in bad.error
    assert bad.token_ids == alone[POISON][:3]  # what it already produced is kept
    assert pages_checked
    after = engine.stats()
    assert after["request_faults"] - before["request_faults"] == 1
    assert after["engine_faults"] == before["engine_faults"]
    check_all_pages_free(engine)


def test_a_request_failing_in_its_first_prefill_fails_alone(llm, alone, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "sampler", PoisonedSampler(engine.runner.sampler, poisoned("bad")))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"p-{i}", p, GREEDY)
    engine.add_request("bad", POISON, GREEDY)
    finals, _ = run_all(engine)
    assert [finals[f"p-{i}"].token_ids for i in range(4)] == [alone[p] for p in PROMPTS]
    assert finals["bad"].finish_reason == "error" and finals["bad"].token_ids == []
    check_all_pages_free(engine)


def test_a_transient_fault_is_retried_and_fails_nobody(llm, alone, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine, "isolation", StepIsolation(FlakyRunner(engine.runner, 1)))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"t-{i}", p, GREEDY)
    engine.step()  # prefills all four; the fault hits this step
    finals, _ = run_all(engine)
    assert [finals[f"t-{i}"].token_ids for i in range(4)] == [alone[p] for p in PROMPTS]
    check_all_pages_free(engine)


def test_a_fault_no_request_explains_fails_the_step_once_retried(llm, alone, monkeypatch):
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"u-{i}", p, GREEDY)
    for _ in range(3):
        engine.step()
    runner = FlakyRunner(engine.runner, 10**6)  # every run fails: alone, together, retried
    monkeypatch.setattr(engine, "isolation", StepIsolation(runner))
    before = engine.stats()
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == [f"u-{i}" for i in range(4)]
    for o in outs:
        assert o.finished and o.finish_reason == "error" and "injected engine fault" in o.error
        assert o.token_ids == alone[PROMPTS[int(o.request_id[2:])]][:3]
    after = engine.stats()
    assert after["engine_faults"] - before["engine_faults"] == 1
    assert after["request_faults"] == before["request_faults"]
    assert "injected engine fault" in after["last_engine_fault"]
    check_all_pages_free(engine)
    runner.failures = 0  # the fault is gone: the engine serves again
    assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == alone[PROMPTS[1]]


def test_admission_refuses_what_could_break_a_step(llm):
    """The typed errors of the Python API: every value is checked (and the
    engine keeps its own copy) before the request can reach a step."""
    engine = llm.engine
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("s", "hi \ud800")
    assert (e.value.param, e.value.code) == ("prompt", "invalid_text")
    for bad in ({"seed": 2**70}, {"seed": 2**64}, {"temperature": True}, {"temperature": float("nan")},
                {"top_p": float("inf")}, {"stop": ["\udfff"]}, {"max_tokens": 2.0}, {"logprobs": 1}):
        with pytest.raises(InvalidSamplingParams) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad)), bad
    params = SamplingParams(temperature=1, top_k=0, seed=2**64 - 1)
    assert (type(params.temperature), params.top_k) == (float, -1)  # normalized
    params.seed = 2**70  # changed after it was checked: admission checks again
    with pytest.raises(InvalidSamplingParams):
        engine.add_request("m", "hi", params)
    check_all_pages_free(engine)
