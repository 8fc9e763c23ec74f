"""The prefix hits of capacity.py's batch-8 row: 8 prompts of 2,048 tokens
prefilled (one token out), then the same 8 with 129 tokens out; prints the
second pass's prefix-cache hits and the prompt tokens it computed, twice.
Usage: python prefix_hits.py one|two (one pool, or the sliding layers' own)"""
import sys
import time

from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

MODEL = "synthetic:gemma-3-1b:qoq-g128"
llm = LLM(MODEL, kv_cache_gb=0.1, max_num_seqs=8, max_model_len=32768,
          disable_hybrid_kv_cache_manager=sys.argv[1] != "two")
eng = llm.engine
KEYS = ("prefix_cache_hits", "prefix_cache_queries", "decode_bursts", "num_preemptions", "prompt_tokens",
        "generation_tokens")


def prompt(seed, n):
    return [100 + (i * 7 + seed * 131) % 5000 for i in range(n)]


for rnd in range(2):
    prompts = [prompt(100 * rnd + i, 2048) for i in range(8)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = time.perf_counter() - t
    before = eng.stats()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True))
    second = time.perf_counter() - t
    after = eng.stats()
    print(sys.argv[1], f"prefill {first:.1f}s  second {second:.1f}s", {k: after[k] - before[k] for k in KEYS},
          flush=True)
