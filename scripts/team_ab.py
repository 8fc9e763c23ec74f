#!/usr/bin/env python
"""Two ways of replaying the same captured decode steps, in one process,
switching every 10 steps: on this shared host the memory speed moves by 2x
between minutes, so only steps taken side by side compare.

    python scripts/team_ab.py team [B [P]]   # one team per step (replay.c) or a fork and join per call
    python scripts/team_ab.py head [B [P]]   # the LM head captured with the step, or run op by op after it
    python scripts/team_ab.py prefetch [B [P]]  # threads waiting at the team's barrier fetch the next weights
                                                # and attention's pages, the weights only, or nothing
    python scripts/team_ab.py tree DIR [B [P]]  # the step's kernels built from this tree or from DIR's sources

`tree` compares kernel sources: DIR is another checkout (a git worktree of
an earlier commit, say) whose C kernels have the same signatures; every
kernel library the captured steps call is built again from DIR's sources
(with this tree's flags), and its functions stand in for this tree's in a
second set of plans.

The embedded QoQ model at batch B (P-token prompts, 64 by default), greedy,
300 tokens out, four rounds; the first two steps after each switch are not
counted. Prints the median and first quartile of each way's steps.
"""
import ctypes
import os
import statistics
import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.kernels.cpu import build, replay
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

SWITCH = 10


_flags: dict[str, list[str]] = {}  # kernel source file -> the flags this tree builds it with


def _record_flags() -> None:
    original = build._build

    def recorded(source, flags):
        _flags[os.path.basename(source)] = flags
        return original(source, flags)
    build._build = recorded


def _other_tree(tree: str, captured) -> dict:
    """The captured steps' plans with every kernel built from tree's sources."""
    libs, swapped = {}, {}
    owner = {id(getattr(lib, fn, None)): (name, fn) for name, lib in build._libs.items() if lib is not None
             for fn in dir(lib) if not fn.startswith("_")}

    def other(fn):
        if id(fn) not in owner:
            return fn
        name, fn_name = owner[id(fn)]
        if name not in libs:
            source = os.path.join(tree, "qoqserve", "kernels", "cpu", f"{name}.c")
            libs[name] = ctypes.CDLL(build._build(source, _flags[f"{name}.c"]))
        f = getattr(libs[name], fn_name)
        f.restype, f.argtypes, f.team = fn.restype, fn.argtypes, fn.team
        f.streams = getattr(fn, "streams", None)
        fetcher = getattr(fn, "fetcher", None)
        if fetcher is not None and hasattr(libs[name], fetcher.__name__):  # the other tree's, where it has one
            f.fetcher = getattr(libs[name], fetcher.__name__)
        return f
    for kind, graphs in (("step", captured.steps), ("graph", captured.graphs)):
        for b, g in graphs.items():
            swapped[kind, b] = replay.NativePlan([(other(fn), args) for fn, args in g.ops])
    return swapped


def ways(what: str, captured, arg: str = "") -> dict:
    """name -> a function that puts the engine in that way"""
    if what == "tree":
        mine = {**{("step", b): g._plan for b, g in captured.steps.items()},
                **{("graph", b): g._plan for b, g in captured.graphs.items()}}
        theirs = _other_tree(arg, captured)

        def plans(chosen):
            def put():
                for (kind, b), plan in chosen.items():
                    (captured.steps if kind == "step" else captured.graphs)[b]._plan = plan
            return put
        return {"this tree": plans(mine), os.path.basename(arg.rstrip("/")): plans(theirs)}
    if what == "prefetch":
        flag = ctypes.c_int.in_dll(replay.load(), "replay_prefetch")

        def fetch(on):
            return lambda: setattr(flag, "value", on)
        return {"weights and pages": fetch(1), "weights only": fetch(2), "plain barrier": fetch(0)}
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
    args = sys.argv[1:]
    what = args.pop(0) if args else ""
    tree = args.pop(0) if what == "tree" and args else ""
    batch = int(args[0]) if args else 1
    prompt_len = int(args[1]) if len(args) > 1 else 64
    _record_flags()
    engine = LLM("qoq", num_scheduler_steps=1).engine  # single steps, each timed (no decode bursts)
    if engine.runner.captured is None:
        sys.exit("decode steps are not captured here (see the engine's log)")
    if what == "tree":  # the joined step plans exist from each row count's first step on
        for i, prompt in enumerate(make_prompts(batch, prompt_len, engine.arch.vocab_size, seed=99)):
            engine.add_request(f"w{i}", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    options = ways(what, engine.runner.captured, tree)
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
