"""Eager CPU steps recorded, planned into one arena and run back to back
(kernels/cpu/one_shot.py): the plan never lets two buffers in use at once
share memory, a step's results are those of running it op by op (prefills,
chunked prefills mixed with decodes), and a step torch must compute runs op
by op."""
import gc
import random

import pytest
import torch

from qoqserve.kernels.cpu import elementwise, graph
from qoqserve.kernels.cpu.buffer_plan import plan
from qoqserve.kernels.cpu.one_shot import OneShotSteps
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

needs_c = pytest.mark.skipif(not elementwise.available(), reason="no C compiler")


def test_the_plan_keeps_buffers_in_use_together_apart():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 40)
        sizes = [rng.choice([1, 63, 64, 100, 4096, 10_000]) for _ in range(n)]
        spans = []
        for _ in range(n):
            a = rng.randint(0, 30)
            spans.append((a, a + rng.randint(0, 8)))
        offsets, total = plan(sizes, spans)
        assert total <= sum(-(-s // 64) * 64 for s in sizes)
        for i in range(n):
            assert offsets[i] % 64 == 0 and offsets[i] + sizes[i] <= total
            for j in range(i):
                if spans[i][0] <= spans[j][1] and spans[j][0] <= spans[i][1]:  # in use at once
                    assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i]
    # a chain of buffers, each used only by the call after it: one place for all
    assert plan([4096] * 10, [(i, i + 1) for i in range(0, 20, 2)]) == ([0] * 10, 4096)


@needs_c
def test_a_step_of_c_kernels_runs_as_it_would_op_by_op():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, generator=g)
    x, d = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)

    def step(x, d):  # C kernels only: each makes its output buffer
        h = elementwise.rms_norm(x, w, 1e-6)
        for _ in range(6):  # h updated in place; y dead after the next call
            y, h = elementwise.add_rms_norm(h, d, w, 1e-6)
            h = elementwise.rms_norm(y, w, 1e-6)
        return elementwise.rms_norm(h, w, 1e-6)

    runner = OneShotSteps()
    want = step(x, d)
    got = runner(step, x, d)
    assert not runner.disabled and torch.equal(got, want)
    # 14 buffers of 64 KB, a few in use at once: they share places
    assert 0 < runner.arena_bytes <= 4 * 64 * 1024
    assert torch.equal(runner(step, x, d), want)  # again, in the same arena
    # a recording that cannot allocate (address space): that step runs op by op
    real_empty, refused = graph.empty, []

    def no_memory(*shape, dtype):
        if graph.recording():
            refused.append(shape)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(*shape, dtype=dtype)

    graph.empty = no_memory
    try:
        assert torch.equal(runner(step, x, d), want) and not runner.disabled
    finally:
        graph.empty = real_empty
    assert refused  # the recording did fail
    # a step of fewer rows than the runner's floor runs op by op, unrecorded
    small = OneShotSteps(min_rows=65)
    assert torch.equal(small(step, x, d, rows=64), want) and small.arena_bytes == 0
    assert torch.equal(small(step, x, d, rows=65), want) and small.arena_bytes > 0
    # torch computing inside the step: it runs op by op, now and from then on
    other = OneShotSteps()
    assert torch.equal(other(lambda x, d: step(x * 2, d), x, d), step(x * 2, d))
    assert "aten::" in other.disabled[None]
    assert not graph.recording()


def _generate(model, prompts, params, one_shot, **kw):
    llm = LLM(model, kv_cache_gb=0.05, dtype="float32", **kw)
    assert llm.engine.stats()["one_shot_eager_steps"]  # on wherever decode steps are captured
    llm.engine.runner.mixed = None  # these steps would be replayed from captured graphs
    if not one_shot:
        llm.engine.runner.one_shot = None
    else:
        llm.engine.runner.one_shot.min_rows = 0  # these steps are small: record them all
    outs = llm.generate(prompts, params)
    runner = llm.engine.runner
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    result = [(o.token_ids, o.logprobs) for o in outs], (dict(runner.one_shot.disabled) if runner.one_shot else None)
    del llm
    gc.collect()
    return result


@needs_c
@pytest.mark.parametrize("budget", [None, 16])
def test_eager_steps_run_back_to_back_equal_op_by_op(qoq_tiny, budget):
    # budget 16: prompts prefilled in chunks, in steps mixed with other requests' decodes
    prompts = [[5 + i * 7 + j for j in range(9 + 13 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
    kw = {} if budget is None else {"max_num_batched_tokens": budget, "long_prefill_token_threshold": 8}
    direct, _ = _generate(qoq_tiny, prompts, params, False, **kw)
    batched, disabled = _generate(qoq_tiny, prompts, params, True, **kw)
    assert batched == direct  # tokens and logprobs, exactly
    assert not disabled  # prefills alone and mixed with decodes: every step ran back to back
