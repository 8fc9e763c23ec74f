"""The sliding layers' own page pool on a Gemma-3-1B-shaped QoQ model
(`synthetic:gemma-3-1b:qoq-g128`: random weights of the real shapes, 22
sliding layers of window 512 to 4 global ones, KV4 pages), one pool against
two in one process, taking turns (this machine is shared and noisy):

1. what a fixed KV budget holds: the pools' pages and the longest context;
2. a decode step's cost with the page map (one C call a step): greedy
   decode of 128 tokens at batch 1 and 8 after 2,048-token prompts, EOS ignored;
3. N requests of a PROMPT-token prompt and OUT tokens out each, all sent
   at once, in a budget too small for all of them in one pool: wall time,
   output tokens/s, preemptions, and how many ran at once.

Usage: python capacity.py [KV_GB] [N] [PROMPT] [OUT]"""
import sys
import time

from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

MODEL = "synthetic:gemma-3-1b:qoq-g128"
gb = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
n_req = int(sys.argv[2]) if len(sys.argv) > 2 else 8
prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
out_len = int(sys.argv[4]) if len(sys.argv) > 4 else 64
engines = {name: LLM(MODEL, kv_cache_gb=gb, max_num_seqs=8, max_model_len=32768,
                     disable_hybrid_kv_cache_manager=(name == "one pool"))
           for name in ("one pool", "two pools")}
for name, llm in engines.items():
    st = llm.engine.stats()
    print(f"{name}: KV budget {gb} GiB: main pool {st['num_kv_blocks']} pages of 16 "
          f"({st['kv_bytes_per_token']} B/token), sliding layers' pool {st['num_window_kv_blocks']} pages "
          f"({st['window_kv_bytes_per_token']} B/token); longest context {llm.engine.max_model_len}", flush=True)


def prompt(seed, n):
    return [100 + (i * 7 + seed * 131) % 5000 for i in range(n)]


def decode_rate(llm, batch, seed):
    llm.generate([prompt(seed + i, 2048) for i in range(batch)],
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))  # prefill (prefix-cached next)
    t = time.perf_counter()
    llm.generate([prompt(seed + i, 2048) for i in range(batch)],
                 SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True))
    return time.perf_counter() - t


for batch in (1, 8):
    for rnd in range(2):
        for name, llm in engines.items():
            dt = decode_rate(llm, batch, 1000 * rnd + batch)
            print(f"decode, batch {batch}, 2048-token prompts (prefix hits), 129 tokens: {name} {dt:.2f} s", flush=True)


def serve_all(llm, seed):
    eng = llm.engine
    pre0 = eng.scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i in range(n_req):
        eng.add_request(f"r{seed}-{i}", prompt(seed * 100 + i, prompt_len), params)
    most, t = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        most = max(most, len(eng.scheduler.running))
    return time.perf_counter() - t, eng.scheduler.num_preemptions - pre0, most


for rnd in range(2):
    for name, llm in engines.items():
        dt, pre, most = serve_all(llm, 50 + rnd * 10 + (name == "two pools"))
        print(f"{n_req} requests of {prompt_len} + {out_len} tokens at once: {name}: {dt:.1f} s "
              f"({n_req * out_len / dt:.1f} output tok/s), {pre} preemptions, at most {most} running", flush=True)
