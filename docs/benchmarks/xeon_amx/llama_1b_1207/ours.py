"""qoqserve on a Llama-3.2-1B-shaped model (`synthetic:llama-3.2-1b:FORMAT`:
random weights of the real shapes; speed does not depend on their values),
as llama-bench measures llama.cpp: prefill of one 512-token prompt (pp512:
a fresh prompt each round, no prefix-cache hit) and greedy decode of 128
tokens at batch 1 (tg128), fastest of 3 after a warm-up, through
LLM.generate with the engine's defaults (DTYPE: the activations' dtype
where given). Usage: python ours.py MODEL [DTYPE]"""
import sys
import time

from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

llm = LLM(sys.argv[1], max_num_seqs=8, kv_cache_gb=1.0, **({"dtype": sys.argv[2]} if len(sys.argv) > 2 else {}))
stats = llm.engine.stats()
print(*sys.argv[1:], stats.get("linear_paths"), "LM head:", stats.get("lm_head_kernel"), flush=True)


def prompt(seed):
    return [[100 + (i * 7 + seed) % 5000 for i in range(512)]]


def fastest(run, rounds=3):
    run(0)
    best = float("inf")
    for r in range(1, rounds + 1):
        t = time.perf_counter()
        run(r)
        best = min(best, time.perf_counter() - t)
    return best


one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
pp = fastest(lambda r: llm.generate(prompt(r), one))
tg_params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
tg = fastest(lambda r: llm.generate([[5, 6, 7, 8 + r]], tg_params))
print(f"pp512 {512 / pp:.1f} tok/s   tg128 {128 / tg:.1f} tok/s ({tg / 128 * 1e3:.1f} ms a token)", flush=True)
