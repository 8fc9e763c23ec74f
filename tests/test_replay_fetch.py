"""A captured step's plan knows the weights each GEMM call streams, and a
thread that waits at the team's barrier fetches its share of the next ones
into its L2 (replay.c): which lines, in which order, within what budget."""
import pytest
import torch
from test_captured_step import needs_c
from test_w4a8_packed_gemm import _checkpoint, _input, _packed

from qoqserve.kernels.cpu import elementwise, graph
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, fused_int8_available

pytestmark = needs_c


def _step():
    """A plan of GEMMs (two group sizes, INT8) with other calls before and
    between them; the INT8 one's shares do not start on a line."""
    k = 576
    grouped = _packed(_checkpoint(1024, k, 64, seed=1), 64)
    coarser = _packed(_checkpoint(320, k, 32, seed=2), 32)
    g = torch.Generator().manual_seed(3)
    int8 = PackedInt8Gemm(torch.randint(-128, 128, (200, 100), dtype=torch.int8, generator=g),
                          torch.rand(200, generator=g) * 1e-3, None, None) if fused_int8_available() else None
    x, weight = _input(2, k, torch.float32, seed=4), torch.rand(k, generator=g) + 0.5
    x100 = _input(2, 100, torch.float32, seed=5)

    def step():
        y = elementwise.rms_norm(x, weight, 1e-5)
        out = [elementwise.rms_norm(y, weight, 1e-5), grouped(y), elementwise.rms_norm(x, weight, 1e-5), coarser(y)]
        return out + ([int8(x100)] if int8 is not None else [])
    sg = graph.StepGraph()
    sg.capture(step)
    if sg._plan is None:
        pytest.skip("replay.c does not build here (libffi)")
    return sg, [grouped, coarser] + ([int8] if int8 is not None else [])


def test_each_gemm_call_names_the_weights_it_streams():
    sg, linears = _step()
    gemms = [i for i, (fn, _) in enumerate(sg.ops) if fn.__name__ in ("w4a8_gemm", "int8_linear")]
    want = []
    for i, lin in zip(gemms, linears, strict=True):
        weights = [lin.codes, lin.gparams] if hasattr(lin, "codes") else [lin.packed]
        want += [(i, t.data_ptr(), t.nbytes) for t in weights if t is not None]
    assert sg._plan.spans == want


def _model(spans, thread, threads, budget, waits):
    """The fetch as specified: after call i, the thread's share (its 1/T of each
    span, the start rounded down to a line) of the stream calls after i, one
    after the other; a call's lines are dropped once it has run; no more than
    `budget` bytes ahead of the next stream call, counting whole shares of
    the calls before the one it is in (their bytes / T)."""
    calls = sorted({i for i, _, _ in spans})

    def share(c):
        return [(ptr + (n * thread // threads & ~63), ptr + n * (thread + 1) // threads)
                for i, ptr, n in spans if i == c]

    def before(c):
        return sum(n for i, _, n in spans if i < c)
    out, cur, at = [], None, []
    for after, lines in waits:
        first = next((c for c in calls if c > after), None)
        if cur is None or cur <= after:
            cur, at = first, [lo for lo, _ in share(first)] if first is not None else []
        if cur is None:
            continue
        left = budget - (before(cur) - before(first)) // threads - sum(a - lo for a, (lo, _) in zip(at, share(cur)))
        while lines > 0 and left > 0:
            s = next((s for s, (a, (_, hi)) in enumerate(zip(at, share(cur))) if a < hi), None)
            if s is None:
                nxt = next((c for c in calls if c > cur), None)
                if nxt is None:
                    break
                cur, at = nxt, [lo for lo, _ in share(nxt)]
                continue
            out.append(at[s])
            at[s] += 64
            left -= 64
            lines -= 1
    return out


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("budget", [64 * 40, 100_000, 200_000, 1 << 20])
def test_a_waiting_thread_fetches_its_share_of_the_next_weights_within_its_budget(threads, budget):
    sg, _ = _step()
    plan = sg._plan
    n = len(sg.ops)
    walks = [[(0, 10**6)],  # one long wait before the first GEMM
             [(0, 10**6), (1, 10**6)],  # twice before it: the budget counts what the first wait took
             [(0, 50), (1, 7), (2, 10**6)],  # met early, then after the first GEMM ran: its lines are dropped
             [(i, 30) for i in range(n)],  # a short wait after every call
             [(n - 1, 10**6)]]  # after the last call: nothing ahead
    for thread in range(threads):
        for waits in walks:
            got = plan.fetched_lines(thread, threads, budget, waits)
            assert got == _model(plan.spans, thread, threads, budget, waits), (thread, waits)
    # the whole share of each span, split between the threads with no line lost
    everything = [plan.fetched_lines(t, threads, 1 << 30, [(-1, 10**6)]) for t in range(threads)]
    for _, ptr, nbytes in plan.spans:
        lines = {a for mine in everything for a in mine if ptr <= a < ptr + nbytes}
        assert lines >= set(range(ptr, ptr + nbytes, 64))


def test_a_waiting_thread_runs_attentions_fetcher_in_a_batch_1_step(qoq_tiny):
    # batch 1: thread 1 waits through the serial RoPE before every layer's
    # attention and fetches its pages meanwhile (paged_decode_fetch); the
    # tokens are those of the op-by-op steps (the fetch only moves lines)
    import ctypes
    import gc

    from qoqserve.kernels.cpu import replay
    from qoqserve.llm import LLM
    from qoqserve.sampling_params import SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        eager = LLM(qoq_tiny, kv_cache_gb=0.1, dtype="float32", enforce_eager=True)
        want = eager.generate([[5, 6, 7]], params)[0].token_ids
        del eager
        gc.collect()
        llm = LLM(qoq_tiny, kv_cache_gb=0.1, dtype="float32", num_scheduler_steps=1)
        captured = llm.engine.runner.captured
        plan = captured.graphs[1]._plan
        attention = [i for i, (fn, _) in enumerate(captured.graphs[1].ops) if fn.__name__ == "paged_decode_attention"]
        assert attention and plan.fetchers == attention and plan.team_size == 2
        ran = ctypes.c_long.in_dll(replay.load(), "replay_fetchers_run")
        start = ran.value
        assert llm.generate([[5, 6, 7]], params)[0].token_ids == want
        assert ran.value - start >= len(attention)  # at least once a step of the five replayed
    finally:
        torch.set_num_threads(before)
