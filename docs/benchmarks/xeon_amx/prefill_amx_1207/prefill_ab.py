import sys
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1:]]
llm = LLM(model="qoq", enable_prefix_caching=False)
e = llm.engine
p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
for B, L in shapes:
    best = 0
    for seed in range(3):
        for i, pr in enumerate(make_prompts(B, L, e.arch.vocab_size, seed=seed)):
            e.add_request(f"r{B}-{L}-{seed}-{i}", pr, p)
        t0 = time.perf_counter()
        while e.has_unfinished():
            e.step()
        best = max(best, B * L / (time.perf_counter() - t0))
    print(f"{B}x{L}: {best:.0f} tok/s", flush=True)
