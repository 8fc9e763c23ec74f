"""Tensor parallelism on CPU over gloo (docs/parallel.md): a split engine must
give what the whole one gives, refuse what it cannot split, and fail loudly,
never hang, when a worker dies.

Engines run 2 ranks over tiny models (a spawned worker costs seconds here);
the embedded model has 9 query heads, so its split is 3 ranks.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import httpx
import pytest
import torch
from conftest import in_process_server

from qoqserve.errors import ModelLoadError, WorkerFailedError
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [300, 301, 302, 303, 304]]
N_TOKENS = 6
SMALL = dict(num_blocks=48, max_model_len=128, enforce_eager=True)


def greedy(llm: LLM, prompts=PROMPTS, n=N_TOKENS):
    """(tokens, their logprobs) of each prompt, greedy, all in one batch."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def compare(ref: LLM, model: str, tp: int, logprob_tol: float, **kw) -> None:
    """Greedy tokens of the split engine == the whole one's (ref), token for
    token; logprobs of the generated and of every prompt token within logprob_tol."""
    want_tokens, want_lp = greedy(ref)
    want_prompt = ref.engine.prompt_logprobs(PROMPTS[0])
    with LLM(model, tensor_parallel_size=tp, **kw) as split:
        assert split.engine.stats()["tensor_parallel_size"] == tp
        tokens, lp = greedy(split)
        prompt = split.engine.prompt_logprobs(PROMPTS[0])  # the scored (perplexity) path
    assert tokens == want_tokens
    diff = max(abs(a - b) for x, y in zip(lp, want_lp) for a, b in zip(x, y))
    assert diff <= logprob_tol, diff
    torch.testing.assert_close(prompt, want_prompt, atol=logprob_tol, rtol=0)


# fp32: the all-reduce sums two fp32 partials where one GEMM summed all K:
# rounding-level differences. W8A8 and W4A8: each rank quantizes its slice of
# a row-parallel input with its own per-token scale (docs/parallel.md), a
# different (finer) rounding of the same activations; W8A8's per-channel
# weight scales are per slice too. KV4/KV8 pages: each rank's hold its heads.
@pytest.mark.parametrize("fmt", ["fp32", "w8a8kv8", "w4a8kv4"])
def test_two_ranks_match_one(fmt, request):
    qoq = request.getfixturevalue("qoq_tiny") if fmt == "w4a8kv4" else None
    model, kw, tol = {
        "fp32": ("synthetic:tiny", dict(dtype="float32"), 1e-4),
        "w8a8kv8": ("synthetic:tiny", dict(dtype="float32", quantization="w8a8", kv_cache_dtype="int8"),
                    0.05),
        "w4a8kv4": (qoq, dict(dtype="float32"), 0.05),
    }[fmt]
    compare(LLM(model, **SMALL, **kw), model, 2, tol, **SMALL, **kw)


def test_embedded_model_on_three_ranks_matches_one(reference_llm, default_gguf_path):
    # 9 query heads, 3 KV heads: 3 ranks of 3 query heads and 1 KV head each
    compare(reference_llm, default_gguf_path, 3, 1e-3, dtype="float32", kv_cache_gb=0.1,
            max_model_len=512)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_worker_starts():
    # the embedded model's shapes (9 query heads, 3 KV heads), random weights
    with pytest.raises(ModelLoadError, match="does not divide the 9 attention heads"):
        LLM("synthetic:smollm2-135m", tensor_parallel_size=2, **SMALL)
    with pytest.raises(ValueError, match="positive integer"):
        LLM("synthetic:tiny", tensor_parallel_size=0, **SMALL)
    assert not multiprocessing.active_children()  # refused before spawning anyone


def test_groups_that_straddle_a_shard_boundary_are_refused():
    # g128 over o_proj's 128 inputs: 2 ranks would each get half a group
    with pytest.raises(ModelLoadError, match="quantization group"):
        LLM("synthetic:tiny:qoq-g128", tensor_parallel_size=2, **SMALL)


def test_a_killed_worker_mid_request_fails_the_engine_and_the_server_answers_503():
    llm = LLM("synthetic:tiny", tensor_parallel_size=2, dtype="float32", **SMALL)
    try:
        (pid,) = llm.engine.executor.pids
        body = {"prompt": "t5 t6 t7", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        with in_process_server(llm.engine) as (base, async_engine), httpx.Client(timeout=60) as client:
            events = []
            with client.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and not events:
                        os.kill(pid, signal.SIGKILL)  # the request is running
                        killed = time.monotonic()
                    events.append(line)
            assert time.monotonic() - killed < 30
            assert any('"error"' in e for e in events), events[-3:]  # told, not cut off silently
            deadline = time.monotonic() + 30
            while async_engine.is_alive:
                assert time.monotonic() < deadline, "the engine loop did not stop"
                time.sleep(0.05)
            assert client.get(base + "/health").status_code == 503
            r = client.post(base + "/v1/completions", json=body)
            assert r.status_code == 503, r.text
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
