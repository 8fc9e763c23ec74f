"""Decode for perf: waves of B prompts of CTX tokens, 200 greedy tokens each,
for SECONDS. python decode_loop.py B CTX SECONDS"""

import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

eng = LLM("qoq").engine
B = int(sys.argv[1])
ctx = int(sys.argv[2])
dur = float(sys.argv[3])
prompts = make_prompts(B, ctx, eng.arch.vocab_size, seed=1)
t_end = time.time() + dur
w = 0
print("start", flush=True)
while time.time() < t_end:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{w}_{i}", p, params)
    while eng.has_unfinished():
        eng.step()
    w += 1
print("waves", w, flush=True)
