"""Steps with prefill chunks replayed from captured graphs
(engine/captured_mixed.py): the same tokens and logprobs as op by op, bit
for bit, for prompts chunked at several sizes, mixed with other requests'
decodes, with prefix-cache hits, under preemption; a shape replays on new
values; a recording that would freeze a step's values is refused."""
import gc

import pytest

from qoqserve.engine import captured_mixed
from qoqserve.kernels.cpu import elementwise, float_linear
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

needs_c = pytest.mark.skipif(not (elementwise.available() and float_linear.available()),
                             reason="no C compiler")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)


def _generate(model, prompts, mixed: bool, params=PARAMS, **kw):
    llm = LLM(model, dtype="float32", **({"kv_cache_gb": 0.05} | kw))
    runner = llm.engine.runner
    assert runner.mixed is not None  # on wherever decode steps are captured
    if not mixed:
        runner.mixed = None
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] and not llm.engine.has_unfinished()
    result = [(o.token_ids, o.logprobs) for o in outs], runner.mixed, stats
    del llm
    gc.collect()
    return result


@needs_c
@pytest.mark.parametrize("budget", [1, 7, 64, None])
def test_mixed_steps_replayed_equal_op_by_op(qoq_tiny, budget, monkeypatch):
    monkeypatch.setattr(captured_mixed, "CAPTURE_AFTER", 0)  # capture every shape at once
    # budget 1 / 7 / 64: prompts prefilled in chunks of that many tokens, beside
    # other requests' decodes; None: whole prompts, several in one step
    prompts = [[5 + i * 7 + j for j in range(9 + 13 * i)] for i in range(3)]
    kw = {} if budget is None else {"max_num_batched_tokens": max(budget, 4), "long_prefill_token_threshold": budget}
    eager, _, _ = _generate(qoq_tiny, prompts, False, **kw)
    replayed, mixed, _ = _generate(qoq_tiny, prompts, True, **kw)
    assert replayed == eager  # tokens and logprobs, exactly
    assert mixed.graphs and not mixed.failed and sum(mixed.replays.values()) > 0
    if budget in (1, 7):  # many chunks of one shape: one graph, replayed on new values
        assert max(mixed.replays.values()) >= 2
    if budget is None:  # three prompts in one step: captured as four chunks, one of them empty
        assert (0, 80, 4) in mixed.graphs
    alone = [_generate(qoq_tiny, [p], True, **kw)[0][0] for p in prompts[1:3]]
    assert alone == replayed[1:3]  # a request alone = among others


@needs_c
def test_replayed_with_prefix_cache_hits_and_preemption(qoq_tiny, monkeypatch):
    monkeypatch.setattr(captured_mixed, "CAPTURE_AFTER", 0)
    shared = [3 + (j * 11) % 200 for j in range(64)]  # 4 pages of 16, hit by the later prompts
    prompts = [shared + [7 + i * 13 + j for j in range(10 + 3 * i)] for i in range(6)]
    # 12 pages: the shared prefix plus ~3 own pages each for six sequences do not fit
    kw = {"num_blocks": 12, "max_num_batched_tokens": 32}
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=True)
    eager, _, _ = _generate(qoq_tiny, prompts, False, params, **kw)
    replayed, mixed, stats = _generate(qoq_tiny, prompts, True, params, **kw)
    assert replayed == eager
    assert mixed.graphs and sum(mixed.replays.values()) > 0
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0


@needs_c
def test_a_shape_is_captured_the_second_time_it_is_seen(qoq_tiny):
    assert captured_mixed.CAPTURE_AFTER == 1
    prompts = [[5 + j for j in range(20)], [9 + j for j in range(20)], [13 + j for j in range(20)]]
    llm = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32")
    mixed = llm.engine.runner.mixed
    for i, p in enumerate(prompts):  # one at a time: three prefills of the same shape
        llm.generate([p], PARAMS)
        assert len(mixed.graphs) == (1 if i >= 1 else 0) and sum(mixed.replays.values()) == i


@needs_c
def test_a_recording_that_would_freeze_step_values_runs_op_by_op(qoq_tiny, monkeypatch):
    monkeypatch.setattr(captured_mixed, "CAPTURE_AFTER", 0)
    real_meta = captured_mixed.CapturedMixed._meta

    def lists(self, key):  # query offsets as a list: the kernel would get a tensor made from it
        ids, positions, meta = real_meta(self, key)
        meta.query_starts = meta.query_starts.tolist()
        return ids, positions, meta

    prompts = [[5 + i * 7 + j for j in range(9 + 13 * i)] for i in range(3)]
    kw = {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 8}
    eager, _, _ = _generate(qoq_tiny, prompts, False, **kw)
    monkeypatch.setattr(captured_mixed.CapturedMixed, "_meta", lists)
    outs, mixed, _ = _generate(qoq_tiny, prompts, True, **kw)
    assert outs == eager and not mixed.graphs
    assert mixed.failed and all("made while recording" in why for why in mixed.failed.values())


@needs_c
def test_graphs_beyond_the_cap_are_dropped_and_captured_again(qoq_tiny, monkeypatch):
    monkeypatch.setattr(captured_mixed, "CAPTURE_AFTER", 0)
    monkeypatch.setattr(captured_mixed, "MAX_GRAPHS", 1)
    prompts = [[5 + i * 7 + j for j in range(9 + 13 * i)] for i in range(3)]
    kw = {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 8}
    eager, _, _ = _generate(qoq_tiny, prompts, False, **kw)
    replayed, mixed, _ = _generate(qoq_tiny, prompts, True, **kw)
    assert replayed == eager and len(mixed.graphs) == 1
    assert len(mixed.replays) > 1  # several shapes ran, one graph kept at a time
