"""Batch-32 greedy decode of the default W4A8KV4 model through the engine as
served (captured steps, bursts): ms per step as the contexts grow from the
150-token prompts to 750 tokens, every 50 steps."""
import time

from qoqserve.bench.offline import make_prompts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

BATCH, PROMPT, OUT, EVERY = 32, 150, 600, 50
engine = LLM("qoq", max_num_seqs=BATCH).engine
params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
for i, prompt in enumerate(make_prompts(BATCH, PROMPT, engine.arch.vocab_size, seed=1)):
    engine.add_request(f"r{i}", prompt, params)


def steps_done() -> int:
    running = engine.scheduler.running
    if not running:  # none admitted yet, or all done
        return OUT if not engine.has_unfinished() else 0
    return min(len(s.output_token_ids) for s in running)


while steps_done() < 10:
    engine.step()
last_t, last_n = time.perf_counter(), steps_done()
while engine.has_unfinished():
    engine.step()
    n = steps_done()
    if n - last_n >= EVERY or (n > last_n and not engine.has_unfinished()):
        t = time.perf_counter()
        print(f"context {PROMPT + last_n}-{PROMPT + n}: {(t - last_t) * 1e3 / (n - last_n):.2f} ms/step", flush=True)
        last_t, last_n = t, n
