"""Back-to-back prefills for perf: B random-token prompts of L tokens, one token
each, for SECONDS (prefix cache off). python prefill_loop.py B L SECONDS"""

import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

llm = LLM("qoq", enable_prefix_caching=False)
eng = llm.engine
B, L = int(sys.argv[1]), int(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
t_end = time.time() + float(sys.argv[3])
r = 0
while time.time() < t_end:
    for i, p in enumerate(make_prompts(B, L, eng.arch.vocab_size, seed=r)):
        eng.add_request(f"r{r}_{i}", p, params)
    t0 = time.time()
    while eng.has_unfinished():
        eng.step()
    r += 1
    print(r, B * L / (time.time() - t0), flush=True)
