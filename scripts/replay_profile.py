#!/usr/bin/env python
"""Per-kernel time inside captured decode steps: the embedded QoQ model at
batch B (P-token prompts, 64 by default), each C call of the captured graph
timed over 50 replays, beside a plain replay and the LM head's graph
(docs/benchmarks.md, roofline).
Then the fastest of 100 native replays of the GEMM calls alone, of every
other call alone, of the whole graph, and of a whole engine step: what the
step spends in its weights' stream, in the rest and around the replay.

    python scripts/replay_profile.py [B [P]]
"""
import collections
import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.bench.timing import fastest_call
from qoqserve.kernels.cpu.replay import NativePlan
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

REPLAYS = 50


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    engine = LLM("qoq", num_scheduler_steps=1).engine  # single steps (no decode bursts)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch, prompt_len, engine.arch.vocab_size, seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    runner = engine.runner
    if runner.captured is None:
        sys.exit("decode steps are not captured here (see the engine's log)")
    # prefill (in as many chunks as the prompts take), then decode steps in the
    # captured graph: until then its input buffers hold empty contexts, and
    # its attention calls would be timed on nothing
    for _ in range(200):
        engine.step()
        if int(runner.captured.context_lens[:batch].min()) > prompt_len:
            break
    else:
        sys.exit("the batch never reached a captured decode step")
    graph = runner.captured.graphs[runner.captured.bucket(batch)]
    spent, calls = collections.Counter(), collections.Counter()
    for _ in range(REPLAYS):
        for fn, args in graph.ops:
            start = time.perf_counter()
            fn(*args)
            spent[fn.__name__] += time.perf_counter() - start
            calls[fn.__name__] += 1
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    replay = (time.perf_counter() - start) / REPLAYS
    head_graph = runner.captured.heads.get(batch)  # the LM head over the real rows, captured apart
    start = time.perf_counter()
    for _ in range(REPLAYS):
        head_graph.replay() if head_graph else runner.model.compute_logits(graph.output[:batch])  # and the argmax
    head = (time.perf_counter() - start) / REPLAYS
    print(f"batch {batch}, {prompt_len}-token prompts: {len(graph.ops)} calls per replay, "
          f"replay {replay * 1e3:.2f} ms, LM head {head * 1e3:.2f} ms")
    for name, t in spent.most_common():
        print(f"  {name:28s} {t / REPLAYS * 1e3:7.3f} ms/step {calls[name] // REPLAYS:4d} calls "
              f"{t / calls[name] * 1e6:7.1f} us/call")
    gemms = [op for op in graph.ops if op[0].__name__ == "w4a8_gemm"]
    rest = [op for op in graph.ops if op[0].__name__ != "w4a8_gemm"]
    for what, ops in (("GEMM calls", gemms), ("other calls", rest), ("whole graph", graph.ops)):
        best = fastest_call(NativePlan(ops).run, 100)
        print(f"fastest native replay of the {what} ({len(ops)}): {best * 1e3:.3f} ms")
    print(f"fastest engine step: {fastest_call(engine.step, 100) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
