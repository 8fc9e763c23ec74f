import sys
import time

from qoqserve.bench.structured import SCHEMA
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams, StructuredOutputs

llm = LLM("qoq", max_num_seqs=32)
held = SamplingParams(
    temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=StructuredOutputs(json=SCHEMA)
)
free = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
prompts = [f"Write a list of {i} people as JSON." for i in range(32)]
llm.generate(prompts[:4], held)
res = {"free": [], "json": []}
for r in range(3):
    for name, p in (("free", free), ("json", held)):
        t = time.perf_counter()
        llm.generate(prompts, p)
        res[name].append(32 * 64 / (time.perf_counter() - t))
print(
    sys.argv[1],
    " ".join(f"{k} best {max(v):.0f} tok/s ({', '.join(f'{x:.0f}' for x in v)})" for k, v in res.items()),
    f"json/free {max(res['json']) / max(res['free']):.3f}",
    flush=True,
)
