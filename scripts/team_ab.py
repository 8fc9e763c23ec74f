#!/usr/bin/env python
"""Two ways of replaying the same captured decode steps, in one process,
switching every 10 steps: on this shared host the memory speed moves by 2x
between minutes, so only steps taken side by side compare.

    python scripts/team_ab.py team [B [P]]   # one team per step (replay.c) or a fork and join per call
    python scripts/team_ab.py head [B [P]]   # the LM head captured with the step, or run op by op after it

The embedded QoQ model at batch B (P-token prompts, 64 by default), greedy,
300 tokens out, four rounds; the first two steps after each switch are not
counted. Prints the median and first quartile of each way's steps.
"""
import statistics
import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.kernels.cpu import replay
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

SWITCH = 10


def ways(what: str, captured) -> dict:
    """name -> a function that puts the engine in that way"""
    if what == "head":
        if not captured.with_head:
            sys.exit("the LM head is not captured here")

        def head(on):
            return lambda: setattr(captured, "with_head", on)
        return {"captured head": head(True), "head op by op": head(False)}
    if what != "team":
        sys.exit(__doc__)
    alone = {}
    team_size = replay.team_size
    replay.team_size = lambda threads: 0  # every call forks and joins its own team
    try:
        for size, g in captured.graphs.items():
            alone[size] = replay.NativePlan(g.ops)
    finally:
        replay.team_size = team_size
    teams = {size: g._plan for size, g in captured.graphs.items()}
    captured.with_head = False  # the decode graphs alone, both ways

    def plans(chosen):
        def put():
            for size, g in captured.graphs.items():
                g._plan = chosen[size]
        return put
    return {"one team": plans(teams), "fork per call": plans(alone)}


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    engine = LLM("qoq").engine
    if engine.runner.captured is None:
        sys.exit("decode steps are not captured here (see the engine's log)")
    options = ways(what, engine.runner.captured)
    times = {name: [] for name in options}
    for rnd in range(4):
        for i, prompt in enumerate(make_prompts(batch, prompt_len, engine.arch.vocab_size, seed=rnd)):
            engine.add_request(f"r{rnd}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=300,
                                                                     ignore_eos=True))
        engine.step()  # the prefill
        n = 0
        while engine.has_unfinished():
            name = list(options)[(n // SWITCH) % len(options)]
            options[name]()
            start = time.perf_counter()
            engine.step()
            if n % SWITCH >= 2:
                times[name].append(time.perf_counter() - start)
            n += 1
    for name, t in times.items():
        t.sort()
        print(f"batch {batch}, {prompt_len}-token prompts, {name:14s}: median {statistics.median(t) * 1e3:.3f} ms, "
              f"first quartile {t[len(t) // 4] * 1e3:.3f} ms ({len(t)} steps)")


if __name__ == "__main__":
    main()
