"""Decode throughput per precision and batch size, plus the largest batch a
fixed KV budget holds. All precisions run in one process, one after another,
on the same prompts.

Decode throughput = (tokens generated after each sequence's first) / (wall
time of the decode steps); prefill steps are timed separately.

Each row also states its memory-bandwidth bound: the bytes a decode step must
read (every linear's resident weights, the LM head's, and the batch's KV pages
at the mean context) over the read bandwidth measured just before the row,
and how many times that bound the measured step took.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

from qoqserve.bench.offline import make_prompts
from qoqserve.bench.precisions import engine_kwargs, get_precision, model_for
from qoqserve.bench.timing import read_bandwidth
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams


@dataclass
class DecodeResult:
    precision: str
    batch: int
    prefill_s: float
    decode_s: float
    decode_tok_per_s: float
    weight_mb: float
    kv_bytes_per_token: int
    max_batch_in_budget: int
    step_read_mb: float  # what one decode step must read (module docstring)
    bandwidth_gbs: float  # read bandwidth measured before the row
    x_bound: float  # measured step time / (step_read_mb / bandwidth)


def step_read_bytes(stats: dict, batch: int, context: float) -> float:
    """Bytes one decode step of `batch` sequences at mean `context` must read."""
    window = min(context, stats["sliding_window"] or context)  # what the sliding layers with a pool read
    return (stats["linear_weight_bytes"] + stats["lm_head_read_bytes"]
            + batch * (context * stats["kv_bytes_per_token"] + window * stats["window_kv_bytes_per_token"]))


def run_batch(llm, batch: int, input_len: int, output_len: int, seed: int | None = None,
              params: list[SamplingParams] | None = None) -> tuple[float, float, int]:
    """seed: of the prompts (default: the batch size); the warm-up uses others,
    or the timed prefill would be a prefix-cache hit. params: one per request
    (default: greedy, output_len tokens, EOS ignored)."""
    engine = llm.engine
    default = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = make_prompts(batch, input_len, engine.arch.vocab_size, seed=batch if seed is None else seed)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{batch}-{i}", p, params[i] if params else default)
    prefill = decode = 0.0
    decoded = 0
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if any(len(o.token_ids) == 1 for o in outs):
            prefill += dt
        else:
            decode += dt
            decoded += sum(len(o.delta_token_ids) for o in outs)  # a burst gives several a step
    return prefill, decode, decoded


def bench_decode(precisions: list[str], batches: list[int], input_len: int, output_len: int,
                 kv_budget_gb: float, compile: bool, threads_note: str = "",
                 enforce_eager: bool = False, sampling: dict | None = None) -> list[DecodeResult]:
    """sampling: every request's SamplingParams fields (e.g. temperature, top_p);
    default greedy."""

    results = []
    for name in precisions:
        p = get_precision(name)
        llm = LLM(model_for(p, None), kv_cache_gb=kv_budget_gb, max_num_seqs=max(batches), compile=compile,
                  enforce_eager=enforce_eager,
                  max_num_batched_tokens=max(batches) * input_len, **engine_kwargs(p, "cpu"))
        stats = llm.engine.stats()
        per_seq_blocks = -(-(input_len + output_len) // stats["block_size"])
        max_batch = stats["num_kv_blocks"] // per_seq_blocks
        # warm-up; with --compile, batch 1 and batch >1 are separate graphs (dynamo
        # specializes size 1), so both are compiled before anything is timed
        for b in sorted({1, 2}):
            run_batch(llm, b, input_len, 4, seed=10_000 + b)
        for b in batches:
            bandwidth = read_bandwidth()
            params = ([SamplingParams(max_tokens=output_len, ignore_eos=True, seed=i, **sampling) for i in range(b)]
                      if sampling else None)
            prefill, decode, decoded = run_batch(llm, b, input_len, output_len, params=params)
            step_bytes = step_read_bytes(stats, b, input_len + output_len / 2)
            step_s = decode / (decoded / b)
            r = DecodeResult(name, b, prefill, decode, decoded / decode, stats["weight_bytes"] / 2**20,
                             stats["kv_bytes_per_token"], max_batch, step_bytes / 2**20, bandwidth / 1e9,
                             step_s * bandwidth / step_bytes)
            results.append(r)
            print(f"{name:<8} batch {b:>3}: decode {r.decode_tok_per_s:8.1f} tok/s  "
                  f"(prefill {prefill:5.2f}s, decode {decode:6.2f}s)  weights {r.weight_mb:6.1f} MiB  "
                  f"KV {r.kv_bytes_per_token} B/token  max batch in {kv_budget_gb} GiB: {max_batch}  "
                  f"step {step_s * 1e3:.2f} ms reads {r.step_read_mb:.1f} MiB: {r.x_bound:.2f}x its bound at "
                  f"{r.bandwidth_gbs:.1f} GB/s", flush=True)
        del llm
        gc.collect()
    return results


def as_dicts(results) -> list[dict]:
    return [asdict(r) for r in results]
