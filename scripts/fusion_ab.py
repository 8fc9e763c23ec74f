#!/usr/bin/env python
"""A fused input (residual add + RMSNorm, or SiLU * mul, made inside the packed
W4A8 GEMM) against the separate C op, in one process: the embedded QoQ
model's batch-B decode graph captured twice, with the fusion and with the
linear method's input hook forced back to the separate op, then each graph
replayed with the LM head after it, taking turns (docs/benchmarks.md).

    python scripts/fusion_ab.py [--fusion norm|silu] [--batch B] [--rounds 8]
"""
import argparse
import statistics
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.bench.timing import fastest_call
from qoqserve.layers.linear import LinearMethod
from qoqserve.layers.quantization import qoq_methods
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

HOOKS = {"norm": "input_from_norm", "silu": "input_from_silu_mul"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fusion", choices=sorted(HOOKS), default="norm")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    engine = LLM("qoq", num_scheduler_steps=1).engine  # single steps (no decode bursts)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(args.batch, 64, engine.arch.vocab_size, seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(5):
        engine.step()
    captured = engine.runner.captured
    if captured is None:
        raise SystemExit("decode steps are not captured here (see the engine's log)")
    fused = captured.graphs[captured.bucket(args.batch)]
    hook = HOOKS[args.fusion]
    setattr(qoq_methods.QoQPackedMethod, hook, getattr(LinearMethod, hook))
    captured.graphs.clear()  # re-recorded with the separate op; its own buffers
    captured.capture_all()
    separate = captured.graphs[captured.bucket(args.batch)]
    head = engine.runner.model.compute_logits

    def step(g):
        return lambda: head(g.replay()[:args.batch])

    runs = {"fused": step(fused), "separate": step(separate)}
    best = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            best[name].append(fastest_call(fn, 100))
    single = {k: [] for k in runs}
    for _ in range(400):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            single[name].append(time.perf_counter() - start)
    print(f"{args.fusion} fusion, batch {args.batch}: {len(fused.ops)} C calls fused, {len(separate.ops)} separate")
    for name in runs:
        print(f"  {name:9s} fastest of {args.rounds} x 100 replays + head {min(best[name]) * 1e3:.3f} ms "
              f"(median round {statistics.median(best[name]) * 1e3:.3f}); 400 interleaved calls median "
              f"{statistics.median(single[name]) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
