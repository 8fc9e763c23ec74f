#!/usr/bin/env python
"""Batch-1 decode against its memory-bandwidth bound, side by side over time.

This host's read rate flips between ~35 and ~85 GB/s from one minute (or
second) to the next, so `bench decode`'s one probe per row says little about
the row's own seconds. Here each round is a read-bandwidth probe, one
request decoded at batch 1, and another probe; a round counts only where
its two probes agree within 10% (the rate did not flip under it), and its
ratio is its time per token over the step's bytes at the mean of the two.

    python scripts/bound_watch.py [MINUTES [TOKENS]]

The embedded QoQ model, default settings (decode bursts on), a 64-token
prompt, TOKENS (128) greedy tokens a round. Prints each round, then the
ratio's median and range per bandwidth band.
"""
import statistics
import sys
import time

from qoqserve.bench.decode import step_read_bytes
from qoqserve.bench.offline import make_prompts
from qoqserve.bench.timing import read_bandwidth
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

BANDS = ((0, 45), (45, 60), (60, 72), (72, 1000))  # GB/s


def main() -> None:
    minutes = float(sys.argv[1]) if len(sys.argv) > 1 else 10
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    llm = LLM("qoq")
    engine, stats = llm.engine, llm.engine.stats()
    step_bytes = step_read_bytes(stats, 1, 64 + tokens / 2)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rounds, end, rnd = [], time.monotonic() + 60 * minutes, 0
    while time.monotonic() < end:
        rnd += 1
        engine.add_request(f"r{rnd}", make_prompts(1, 64, engine.arch.vocab_size, seed=rnd)[0], params)
        engine.step()  # the prefill, not timed
        before = read_bandwidth(256, 4)
        start, done = time.perf_counter(), 0
        while engine.has_unfinished():
            done += sum(len(o.delta_token_ids) for o in engine.step())
        per_token = (time.perf_counter() - start) / done
        after = read_bandwidth(256, 4)
        bw = (before + after) / 2
        steady = abs(before - after) <= 0.1 * bw
        ratio = per_token * bw / step_bytes
        if steady:
            rounds.append((bw / 1e9, per_token * 1e3, ratio))
        note = "" if steady else "  (rate moved: not counted)"
        print(f"{time.strftime('%H:%M:%S')} probes {before / 1e9:5.1f} / {after / 1e9:5.1f} GB/s  "
              f"{per_token * 1e3:.3f} ms a token  {ratio:.2f}x its bound{note}", flush=True)
    print(f"\n{len(rounds)} steady rounds of {rnd}; step reads {step_bytes / 2**20:.1f} MiB")
    for lo, hi in BANDS:
        band = [r for r in rounds if lo <= r[0] < hi]
        if band:
            ratios = sorted(r[2] for r in band)
            print(f"{lo:3d}-{hi if hi < 1000 else '':>3} GB/s: {len(band):3d} rounds, ratio median "
                  f"{statistics.median(ratios):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}), "
                  f"median {statistics.median(r[1] for r in band):.3f} ms a token")


if __name__ == "__main__":
    main()
