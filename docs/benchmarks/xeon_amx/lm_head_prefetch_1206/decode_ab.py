"""Greedy decode through LLM.generate (the engine as served: captured steps,
bursts), 128 tokens per request, EOS ignored, fastest of 3 rounds, per
batch size: ms per decode step (prefill of the short prompts included)."""

import sys
import time

from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

llm = LLM("qoq", max_num_seqs=32)
p = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
out = []
for b in (1, 4, 32):
    prompts = [f"Tell me a story about the number {i}." for i in range(b)]
    llm.generate(prompts, p)
    best = 1e9
    for r in range(3):
        t = time.perf_counter()
        llm.generate(prompts, p)
        best = min(best, time.perf_counter() - t)
    out.append(f"batch {b}: {best * 1e3 / 128:.2f} ms/step ({b * 128 / best:.0f} tok/s)")
print(sys.argv[1], " | ".join(out), flush=True)
