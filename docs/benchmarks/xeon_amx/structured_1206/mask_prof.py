import time

from qoqserve.bench.structured import SCHEMA
from qoqserve.engine import structured as st
from qoqserve.layers import token_mask as tm
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams, StructuredOutputs

T = {"fill": 0.0, "apply": 0.0, "empty": 0.0, "accept": 0.0, "n_fill": 0}
of, oa, oe, oacc = (
    st.GrammarConstraint.fill_bitmask,
    tm.apply_token_bitmask,
    tm.rows_left_empty,
    st.GrammarConstraint.accept,
)


def fill(self, b, r):
    t = time.perf_counter()
    of(self, b, r)
    T["fill"] += time.perf_counter() - t
    T["n_fill"] += 1


def app(*a):
    t = time.perf_counter()
    oa(*a)
    T["apply"] += time.perf_counter() - t


def emp(*a):
    t = time.perf_counter()
    r = oe(*a)
    T["empty"] += time.perf_counter() - t
    return r


def acc(self, tok):
    t = time.perf_counter()
    oacc(self, tok)
    T["accept"] += time.perf_counter() - t


st.GrammarConstraint.fill_bitmask, tm.apply_token_bitmask, tm.rows_left_empty, st.GrammarConstraint.accept = (
    fill,
    app,
    emp,
    acc,
)
llm = LLM("qoq", max_num_seqs=32)
p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=StructuredOutputs(json=SCHEMA))
prompts = [f"Write a list of {i} people as JSON." for i in range(32)]
llm.generate(prompts[:2], p)
for k in T:
    T[k] = 0
t = time.perf_counter()
outs = llm.generate(prompts, p)
el = time.perf_counter() - t
print(f"total {el * 1e3:.0f} ms; fills {T['n_fill']}, per fill {T['fill'] / T['n_fill'] * 1e6:.1f} us")
for k in ("fill", "apply", "empty", "accept"):
    print(k, f"{T[k] * 1e3:.1f} ms")
print(outs[0].text[:200])
