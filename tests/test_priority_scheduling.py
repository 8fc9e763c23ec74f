"""vLLM's priority scheduling (`--scheduling-policy priority`): the queue in
(priority, arrival) order, the lowest priority preempted first when the page
pool is full, the same greedy tokens whatever the order; under FCFS a
request's priority other than 0 is refused."""
from __future__ import annotations

import httpx
import pytest
from conftest import in_process_server
from test_block_manager import seq, step

from qoqserve.config import SchedulerConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.scheduler import Scheduler
from qoqserve.errors import InvalidRequestError
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

PROMPTS = ["The three primary colors are", "Once upon a time", "The capital of France is", "Water boils at"]


def test_the_queue_runs_in_priority_then_arrival_order():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, scheduling_policy="priority"), BlockManager(64, 4), 64)
    seqs = [seq(name, range(3)) for name in "abcd"]
    for s, rank in zip(seqs, (5, 0, 1, 0)):
        s.priority = rank
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["b", "d", "c", "a"]
    fcfs = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(64, 4), 64)
    for s in seqs:
        fcfs.add(s)
    assert [s.request_id for s in fcfs.waiting] == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(SchedulerConfig(scheduling_policy="lifo"), BlockManager(64, 4), 64)


@pytest.mark.parametrize("policy, victim", [("priority", "a"), ("fcfs", "b")])
def test_a_full_pool_preempts_the_lowest_priority_even_if_it_came_first(policy, victim):
    """a (priority 3) is admitted first, b (priority 0) a step later; when the
    pool runs out, FCFS preempts the newest (b), the priority policy a."""
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, scheduling_policy=policy), bm, 16)
    a, b = seq("a", range(4)), seq("b", range(10, 14))
    a.priority = 3
    sched.add(a)
    step(sched, sched.schedule())
    sched.add(b)
    batch = sched.schedule()
    assert batch.decodes == [a] and batch.prefills == [(b, 4)]
    while sched.num_preemptions == 0:
        step(sched, batch)
        batch = sched.schedule()
    assert [s.request_id for s in sched.waiting] == [victim] and sched.num_preemptions == 1
    assert [s.request_id for s in sched.running] == ["ab".replace(victim, "")]


@pytest.fixture(scope="module")
def llm(default_gguf_path):
    with LLM(default_gguf_path, dtype="float32", kv_cache_gb=0.05, max_model_len=256, max_num_seqs=1,
             scheduling_policy="priority") as llm:
        yield llm


def finish_order(engine, priorities):
    for i, (prompt, rank) in enumerate(zip(PROMPTS, priorities)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6), priority=rank)
    order, tokens = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.token_ids
    return order, tokens


def test_the_engine_serves_by_priority_and_the_tokens_do_not_change(llm, reference_llm):
    order, tokens = finish_order(llm.engine, [2, 0, 3, 1])
    assert order == ["r1", "r3", "r0", "r2"]  # one sequence at a time: the queue's order
    ref = reference_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    assert [tokens[f"r{i}"] for i in range(4)] == [r.token_ids for r in ref]
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), priority=[1, 0])
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref[:2]]


def test_fcfs_refuses_a_priority_and_the_server_takes_it_when_told(reference_llm, llm):
    with pytest.raises(InvalidRequestError) as e:
        reference_llm.engine.add_request("p", PROMPTS[0], SamplingParams(max_tokens=1), priority=1)
    assert e.value.param == "priority"
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "priority": -2}
    with in_process_server(reference_llm.engine) as (base, _):
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    with in_process_server(llm.engine) as (base, _):
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
