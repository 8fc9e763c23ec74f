"""qoqserve on a Gemma-3-1B-shaped model (`synthetic:gemma-3-1b:qoq-g64`:
random weights of the real shapes), as llama-bench measures llama.cpp with
-p 512 -n 128 -d DEPTH: at each depth, a DEPTH-token context is computed
first (not timed; the prefix cache keeps it), then pp512 times 512 more
prompt tokens on top of it and tg128 times 128 greedy tokens decoded
after it, at batch 1; fastest of 3 after a warm-up. Usage: python ours.py
DEPTH [DEPTH ...]"""
import sys
import time

from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

llm = LLM("synthetic:gemma-3-1b:qoq-g64", max_num_seqs=8, kv_cache_gb=1.0, max_model_len=16384)
stats = llm.engine.stats()
print(stats.get("linear_paths"), "LM head:", stats.get("lm_head_kernel"), "sliding layers' pages:",
      stats.get("num_window_kv_blocks"), flush=True)


def tokens(seed, n):
    return [100 + (i * 7 + seed * 131) % 5000 for i in range(n)]


def run(prompt, n):
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t


for depth in map(int, sys.argv[1:]):
    pp, tg = float("inf"), float("inf")
    for r in range(4):  # round 0: warm-up
        context = tokens(1000 * depth + r, depth)
        if depth:
            run(context, 1)  # the context, computed and cached
        t_pp = run(context + tokens(7 + r, 512), 1)
        t_first = run(context + [5], 1)  # what a 129-token run spends before its decode
        t_all = run(context + [5], 129)
        if r:
            pp, tg = min(pp, t_pp), min(tg, t_all - t_first)
    print(f"depth {depth}: pp512 {512 / pp:.1f} tok/s   tg128 {128 / tg:.1f} tok/s ({tg / 128 * 1e3:.1f} ms a token)",
          flush=True)
