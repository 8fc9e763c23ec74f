#!/usr/bin/env python
"""The captured decode step with its buffers in the planned arena (what the
engine runs, kernels/cpu/buffer_plan.py) against the same sizes captured on
fresh buffers, alternating every 10 replays in one process: on this shared
host only steps taken side by side compare.

    python scripts/arena_ab.py [B [ROUNDS]]

The embedded QoQ model, batch B (1), 160-token prompts; checks that both
give the same logits, then prints each way's median step and in how many
rounds the arena was faster.
"""
import statistics
import sys
import time

import torch

from qoqserve.bench.decode import run_batch
from qoqserve.engine.captured_step import CapturedDecode
from qoqserve.llm import LLM


def main() -> None:
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    llm = LLM("qoq", max_num_seqs=64, num_scheduler_steps=1)
    run_batch(llm, b, 160, 8, seed=999)  # leaves real inputs of b rows in the captured buffers
    runner = llm.engine.runner
    cap = runner.captured
    fresh = CapturedDecode(runner.model, runner.kv_caches, cap.sizes, cap.block_tables.shape[1], cap.block_size,
                           cap.pad_slot)
    fresh.arena = None  # capture without relocating: every buffer of its own
    fresh.capture_all()
    for k in ("ids", "positions", "slots", "context_lens", "block_tables"):
        getattr(fresh, k).copy_(getattr(cap, k))
    size = cap.bucket(b)
    ways = {"arena": cap._step(b, cap.graphs[size], cap.heads[b]),
            "fresh": fresh._step(b, fresh.graphs[size], fresh.heads[b])}
    logits = [g.replay()[0].clone() for g in ways.values()]
    print(f"same logits: {torch.equal(*logits)}; arena {cap.arena.block.numel() / 2**20:.2f} MiB")
    times = {k: [] for k in ways}
    for r in range(rounds):
        for k in (list(ways) if r % 2 else list(ways)[::-1]):
            ways[k].replay()
            start = time.perf_counter()
            for _ in range(10):
                ways[k].replay()
            times[k].append((time.perf_counter() - start) / 10 * 1e3)
    ratio = [a / f for a, f in zip(times["arena"], times["fresh"])]
    print(f"batch {b}: arena {statistics.median(times['arena']):.3f} ms, fresh buffers "
          f"{statistics.median(times['fresh']):.3f} ms a step; arena/fresh median {statistics.median(ratio):.3f}, "
          f"arena faster in {sum(x < 1 for x in ratio)} of {rounds} rounds")


if __name__ == "__main__":
    main()
