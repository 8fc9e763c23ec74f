#!/usr/bin/env python
"""Two source trees' decode steps side by side: processes taking turns.

Each round runs one process per tree (the order alternates from round to
round), each timing `engine.step()` of the embedded QoQ model at batch B with
P-token prompts (the median and fastest of N steps after 5 of warm-up), and
prints every pair and how many pairs each tree won. On this shared host the
same build moves by ~10% from one minute to the next, so only pairs taken
in turn say anything.

Each process imports the package from its tree through PYTHONPATH: a script
run as `python scripts/X.py` from a worktree would import the editable
install's tree instead (sys.path[0] is the script's folder, not the tree).

    python scripts/ab_decode_step.py /path/to/worktree . --batch 32 --prompt 128 --rounds 4
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import qoqserve
from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams
batch, prompt, steps = (int(a) for a in sys.argv[1:4])
engine = LLM("qoq").engine
engine.config.scheduler.num_scheduler_steps = 1  # single steps, each timed (no decode bursts)
params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
for i, p in enumerate(make_prompts(batch, prompt, engine.arch.vocab_size, seed=1)):
    engine.add_request(f"r{i}", p, params)
for _ in range(5):
    engine.step()
ts = []
for _ in range(steps):
    t = time.perf_counter()
    engine.step()
    ts.append(time.perf_counter() - t)
print(json.dumps({"median_ms": statistics.median(ts) * 1e3, "fastest_ms": min(ts) * 1e3,
                  "package": qoqserve.__file__}))
"""


def run(tree: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.batch), str(args.prompt), str(args.steps)],
                         env=env, cwd=os.path.abspath(tree), capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["package"].startswith(os.path.abspath(tree)):
        raise SystemExit(f"{tree}: imported {result['package']}, not this tree")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="source tree A (e.g. a git worktree of the commit before)")
    ap.add_argument("b", help="source tree B")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    wins = {"a": 0, "b": 0}
    ratios = []
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        got = {k: run(getattr(args, k), args) for k in order}
        a, b = got["a"]["median_ms"], got["b"]["median_ms"]
        wins["a" if a < b else "b"] += 1
        ratios.append(b / a)
        print(f"round {r + 1} ({order[0]} first): A {a:.2f} ms (fastest {got['a']['fastest_ms']:.2f}), "
              f"B {b:.2f} ms (fastest {got['b']['fastest_ms']:.2f}), B/A {b / a:.3f}", flush=True)
    ratios.sort()
    print(f"batch {args.batch}, {args.prompt}-token prompts, median of {args.steps} steps: "
          f"B faster in {wins['b']} of {args.rounds} rounds; B/A median {ratios[len(ratios) // 2]:.3f}, "
          f"range {ratios[0]:.3f}-{ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
