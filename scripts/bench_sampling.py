#!/usr/bin/env python
"""Decode step time by sampling mode: the embedded QoQ model (plain `LLM("qoq")`
defaults), B requests of 80-token random prompts, 64 tokens each, EOS ignored,
for greedy, temperature 0.8, temperature 0.8 with top_p 0.95 / top_k 50 /
top_p and a seed, with penalties, and with logprobs; the mean over the decode steps after
the first.
Only public APIs, so the same file times an older checkout:

    PYTHONPATH=<tree> python scripts/bench_sampling.py 32
    python scripts/bench_sampling.py kernel   # sample_rows alone: 32 rows of random logits
"""
import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

CASES = {"greedy": dict(temperature=0.0), "t0.8": dict(temperature=0.8),
         "t0.8 top_p0.95": dict(temperature=0.8, top_p=0.95), "t0.8 top_k50": dict(temperature=0.8, top_k=50),
         "t0.8 seeded top_p": dict(temperature=0.8, top_p=0.95, seed=1),
         "greedy rep1.1": dict(temperature=0.0, repetition_penalty=1.1),
         "t0.8 top_p rep1.1": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
         "t0.8 presence/freq0.5": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5),
         "greedy logprobs": dict(temperature=0.0, logprobs=True),
         "greedy top_logprobs5": dict(temperature=0.0, logprobs=True, top_logprobs=5),
         "t0.8 top_p logprobs": dict(temperature=0.8, top_p=0.95, logprobs=True)}


def kernel() -> None:
    """sample_rows over 32 rows of 49,152 random logits (randn x 2.5, ten
    tokens 8 higher: flatter than a model's, so many tokens stay candidates)."""
    import torch

    from qoqserve.kernels.cpu import sample
    g = torch.Generator().manual_seed(0)
    b, v = 32, 49152
    logits = torch.randn(b, v, generator=g) * 2.5
    logits[:, :10] += 8
    u = torch.rand(b, dtype=torch.float64, generator=g).tolist()
    for name, (top_k, top_p) in {"t0.8": (-1, 1.0), "t0.8 top_p0.95": (-1, 0.95), "t0.8 top_k50": (50, 1.0)}.items():
        args = (list(range(b)), [0.8] * b, [0.0] * b, [top_k] * b, [top_p] * b, u)
        for _ in range(5):
            sample.sample_rows(logits, *args)
        start = time.perf_counter()
        for _ in range(200):
            sample.sample_rows(logits, *args)
        print(f"{name:16s} {(time.perf_counter() - start) / 200 * 1e3:.3f} ms per {b} rows", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["kernel"]:
        return kernel()
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    engine = LLM("qoq").engine
    for rep in range(2):  # the first round warms up
        for name, kw in CASES.items():
            params = SamplingParams(max_tokens=64, ignore_eos=True, **kw)
            for i, p in enumerate(make_prompts(batch, 80, engine.arch.vocab_size, seed=rep)):
                engine.add_request(f"{name}-{rep}-{i}", p, params)
            steps, first = 0, None
            while engine.has_unfinished():
                engine.step()
                steps += 1
                if steps == 2:  # the prefill and the first token are behind
                    first = time.perf_counter()
            if rep:
                print(f"{name:22s} batch {batch}: decode {(time.perf_counter() - first) * 1e3 / 62:.2f} ms/step",
                      flush=True)


if __name__ == "__main__":
    main()
