#!/usr/bin/env python
"""Eager steps run back to back (kernels/cpu/one_shot.py) against op by op,
in one process: the embedded QoQ model prefills B x L random-token prompts
(prefix cache off, one token sampled) with the runner's one-shot path on and
off, taking turns, each pair on the same prompts; greedy tokens must match
(docs/benchmarks.md).

    python scripts/one_shot_ab.py [--batch B] [--length L] [--rounds 3] [--pairs 4]
"""
import argparse
import statistics
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args()
    engine = LLM("qoq", enable_prefix_caching=False).engine
    runner, params = engine.runner, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    one_shot = runner.one_shot
    if one_shot is None:
        raise SystemExit("eager steps do not run back to back here (no captured decode step)")
    one_shot.min_rows = 0  # measure the one-shot path at every step size

    def prefill(seed: int):
        for i, p in enumerate(make_prompts(args.batch, args.length, engine.arch.vocab_size, seed=seed)):
            engine.add_request(f"p{seed}-{i}-{id(runner.one_shot)}", p, params)
        start, outs = time.perf_counter(), []
        while engine.has_unfinished():
            outs += engine.step()
        return time.perf_counter() - start, sorted((o.request_id.split("-")[1], o.token_ids) for o in outs)

    prefill(0)
    tokens = args.batch * args.length
    for r in range(args.rounds):
        times = {"op by op": [], "one-shot": []}
        for s in range(args.pairs):
            runner.one_shot = None
            t_eager, out_eager = prefill(1 + r * args.pairs + s)
            runner.one_shot = one_shot
            t_once, out_once = prefill(1 + r * args.pairs + s)
            assert out_once == out_eager, "one-shot steps changed a greedy token"
            times["op by op"].append(t_eager)
            times["one-shot"].append(t_once)
        print(f"{args.batch} x {args.length}, round {r + 1}: " + " | ".join(
            f"{k} best {tokens / min(v):.0f} median {tokens / statistics.median(v):.0f} tok/s"
            for k, v in times.items()) + f"  (arena {one_shot.arena_bytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
