#!/usr/bin/env python
"""Decode bursts on or off, in one process, taking turns per round: on this
shared host the memory speed moves by 2x between minutes, so only rounds run
side by side compare.

    python scripts/burst_ab.py [B [STEPS]]

The embedded QoQ model, B requests of 64-token prompts, greedy, 256 tokens
out each, six rounds per setting (num_scheduler_steps STEPS, 8 by default,
against 1), the order swapped every round. Prints each setting's median time
per decode step (a round's decode time over its tokens per request, the
prefill step not counted).
"""
import statistics
import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    engine = LLM("qoq", num_scheduler_steps=steps).engine
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    times: dict[int, list[float]] = {steps: [], 1: []}
    for rnd in range(7):
        for setting in (steps, 1) if rnd % 2 else (1, steps):
            engine.config.scheduler.num_scheduler_steps = setting
            for i, prompt in enumerate(make_prompts(batch, 64, engine.arch.vocab_size, seed=rnd)):
                engine.add_request(f"r{rnd}-{setting}-{i}", prompt, params)
            engine.step()  # the prefill
            start, tokens = time.perf_counter(), 0
            while engine.has_unfinished():
                tokens += sum(len(o.delta_token_ids) for o in engine.step())
            if rnd:  # the first round warms up
                times[setting].append((time.perf_counter() - start) / tokens * batch)
    for setting, t in times.items():
        print(f"batch {batch}, num_scheduler_steps {setting}: median {statistics.median(t) * 1e3:.3f} ms a step "
              f"({len(t)} rounds: {', '.join(f'{x * 1e3:.3f}' for x in t)})")
    print(f"bursts run: {engine.num_bursts}")


if __name__ == "__main__":
    main()
