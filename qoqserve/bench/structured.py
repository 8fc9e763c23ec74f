"""Decode throughput with part of the batch constrained to a JSON schema:
what the grammar costs (filling each constrained row's token bitmask,
applying the masks to the logits in one call, advancing the matchers).

The schema (a long array of {name, age, email} objects, at least 100 of
them) cannot be finished within the benchmark's tokens, so every request
decodes output_len tokens and the batch stays the same size, constrained
or not. Rounds repeat the fractions in turn (0%, 50%, 100%, 0%, ...) so a
change in the machine's load hits each alike; the best round of each is
reported. On a loaded machine the end-to-end numbers move more than the
grammar costs, so the time the sampler spends on the masks (each
constrained row's fill, then the one apply call) is also timed inside the
steps and reported per decode step, beside the step time of the free batch.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from qoqserve.bench.decode import run_batch
from qoqserve.bench.precisions import engine_kwargs, get_precision, model_for
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "required": ["name", "age", "email"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                   "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\\\.com$"}}}}


@dataclass
class StructuredResult:
    constrained_fraction: float
    batch: int
    decode_tok_per_s: list[float]   # per round
    best_tok_per_s: float
    slowdown_vs_free: float          # 1 - best / best of 0% (0.05: 5% slower)
    mask_ms_per_step: float          # sampler time on the masks per decode step (best round)
    step_ms: float                   # decode step time (best round)


class MaskTimer:
    """Times the sampler's mask work (ConstraintMasks.apply) in every step."""

    def __init__(self, masks):
        self.seconds, self._apply = 0.0, masks.apply
        masks.apply = self

    def __call__(self, logits, constraints):
        t = time.perf_counter()
        self._apply(logits, constraints)
        self.seconds += time.perf_counter() - t


def bench_structured(precision: str, batch: int, fractions: list[float], input_len: int,
                     output_len: int, rounds: int, kv_budget_gb: float) -> list[StructuredResult]:
    p = get_precision(precision)
    llm = LLM(model_for(p, None), kv_cache_gb=kv_budget_gb, max_num_seqs=batch,
              max_num_batched_tokens=batch * input_len, **engine_kwargs(p, "cpu"))
    spec = StructuredOutputs(json=SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    held = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=spec)
    run_batch(llm, 2, input_len, 4, seed=10_000, params=[free, held])  # warm-up, and the grammar compiled
    timer = MaskTimer(llm.engine.runner.sampler.masks)
    runs: dict[float, list[tuple[float, float, float]]] = {f: [] for f in fractions}  # tok/s, mask ms, step ms
    for r in range(rounds):
        for f in fractions:
            n = round(batch * f)
            # constrained rows spread over the batch, not bunched at one end
            params = [held if (i * n) // batch != ((i + 1) * n) // batch else free for i in range(batch)]
            timer.seconds = 0.0
            _, decode, decoded = run_batch(llm, batch, input_len, output_len, seed=100 * r + 1, params=params)
            steps = decoded / batch
            runs[f].append((decoded / decode, 1e3 * timer.seconds / (steps + 1), 1e3 * decode / steps))
            print(f"round {r}: {100 * f:3.0f}% constrained  decode {decoded / decode:7.1f} tok/s  "
                  f"step {runs[f][-1][2]:6.1f} ms  masks {runs[f][-1][1]:5.2f} ms/step", flush=True)
    base = max(s for s, _, _ in runs[fractions[0]])
    out = []
    for f, rs in runs.items():
        best = max(rs)
        out.append(StructuredResult(f, batch, [s for s, _, _ in rs], best[0], 1 - best[0] / base, best[1], best[2]))
    return out


def as_dicts(results) -> list[dict]:
    return [asdict(r) for r in results]
