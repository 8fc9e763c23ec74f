"""Decode steps through GraphedDecode (engine/graphed_decode.py), the CUDA
graph runner, on CPU: its static input buffers, padded buckets and
incremental block tables, with the CUDA path's own kernels (Triton, in its
interpreter) and EagerGraphs standing in for torch.cuda.CUDAGraph (which
needs a GPU: scripts/gpu_check.sh runs that)."""
import gc

import pytest
import torch

from qoqserve.engine.captured_step import reset_decode_rows
from qoqserve.engine.graphed_decode import EagerGraphs, GraphedDecode
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
# three prompts of different lengths: decode batches of 3 run padded in the
# size-4 graph, and two block tables grow past a 16-token page (the decode
# steps write positions 12..16 and 16..20)
PROMPTS = [[5 + i * 7 + j for j in range(12 + 4 * i)] for i in range(3)]
SIZES = [1, 2, 4]


def _llm(ckpt, kernels="triton"):
    return LLM(ckpt, dtype="float32", kernels=kernels, num_blocks=48, enforce_eager=True,
               enable_prefix_caching=False)


class CountingGraphs(EagerGraphs):
    def __init__(self):
        self.captured, self.replays = [], 0

    def capture(self, fn):
        replay, out = super().capture(fn)
        self.captured.append(out.shape[0])

        def counted():
            self.replays += 1
            replay()
        return counted, out


def _graphed(llm, graphs):
    r = llm.engine.runner
    g = GraphedDecode(r.model, r.kv_caches, SIZES, r.kv_caches[0].shape[0], r.block_size,
                      pad_slot=r.num_blocks * r.block_size, device=torch.device("cpu"), graphs=graphs)
    r.use_graphs(g)
    return g


def _run(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] and not llm.engine.has_unfinished()
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.fixture(scope="module")
def eager(qoq_tiny):
    llm = _llm(qoq_tiny)
    assert llm.engine.runner.decode_graphs() is None  # enforce_eager: neither kind of capture
    out = _run(llm)
    del llm
    gc.collect()
    return out


def test_graphed_steps_give_the_eager_tokens(qoq_tiny, eager):
    llm = _llm(qoq_tiny)
    graphs = CountingGraphs()
    g = _graphed(llm, graphs)
    assert llm.engine.runner.graphed is g and g.disabled is None
    assert graphs.captured == [4, 2, 1]  # every size, largest first
    assert llm.engine.runner.stats()["captured_decode_sizes"] == SIZES
    tokens, logprobs = _run(llm)
    assert graphs.replays >= GREEDY.max_tokens - 1  # every decode step replayed a graph
    assert tokens == eager[0]
    for got, ref in zip(logprobs, eager[1]):
        assert got == pytest.approx(ref, abs=1e-5)


def test_padding_rows_write_the_scratch_page(qoq_tiny):
    llm = _llm(qoq_tiny, "torch")
    g = _graphed(llm, EagerGraphs())
    assert [g.bucket(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    r = llm.engine.runner
    pad_page = r.num_blocks  # the page past every one the block manager hands out
    for c in r.kv_caches:  # the capture wrote it already (its rows were all padding)
        c[pad_page].zero_()
    # four sequences decode in the size-4 graph, then, the first one done,
    # three: the row it leaves is padding from then on
    prompts = PROMPTS + [PROMPTS[0][::-1]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 4, 4, 4)]
    llm.generate(prompts, params)
    assert all(c[pad_page].any() for c in r.kv_caches)
    # rows reset as padding read token 0 at position 0 and attend to nothing
    reset_decode_rows(g._np, g._held, 0, g.max_size, g.pad_slot)
    assert g._np["context_lens"].sum() == 0 and (g._np["slots"] == g.pad_slot).all()
    assert all(h is None for h in g._held)


def test_a_failing_capture_runs_op_by_op(qoq_tiny):
    class Refusing(EagerGraphs):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    llm = _llm(qoq_tiny, "torch")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ref = llm.generate(PROMPTS[:2], params)
    g = _graphed(llm, Refusing())
    assert g.disabled and "capturing" in g.disabled and llm.engine.runner.graphed is None
    assert g.bucket(1) is None and llm.engine.runner.decode_graphs() is None
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == [o.token_ids for o in ref]
