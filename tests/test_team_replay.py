"""Captured steps replayed on one team of threads (kernels/cpu/replay.c,
kernels/cpu/team.h): consecutive team-aware calls run in one OpenMP region,
every thread making each call. Each kernel must compute there what its own
eager call computes, bit for bit, on every path that splits work between
threads, and a failing call must stop the team without a hang."""
import gc
import os
import subprocess
import sys

import pytest
import torch
from test_captured_step import GREEDY, needs_c
from test_w4a8_packed_gemm import _checkpoint, _input, _packed

from qoqserve.kernels.cpu import elementwise, float_linear, graph, replay
from qoqserve.kernels.cpu.w4a8_gemm import NormInput, SiluMulInput
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, fused_int8_available
from qoqserve.llm import LLM

pytestmark = needs_c


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two even on a one-core machine: correctness, not speed
    yield
    torch.set_num_threads(before)


def test_the_team_is_the_common_thread_count_of_the_team_calls():
    assert replay.team_size([2, 2, 2]) == 2
    assert replay.team_size([4]) == 4
    assert replay.team_size([2, 1]) == 0  # disagreeing: every call on its own
    assert replay.team_size([1, 1]) == 0  # one thread: nothing to share
    assert replay.team_size([]) == 0


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_gemm_in_a_team_equals_its_eager_calls(two_threads, m, dtype):
    # N x K large enough that even one row is split between the threads; m 1
    # and 2 make their rows on every thread (X_NORM's h update then waits for
    # both), m 5 shares thread 0's quantized rows
    k, n = 576, 1024
    lin = _packed(_checkpoint(n, k, 64, seed=m), 64)
    lin_down = _packed(_checkpoint(n, k, 64, seed=m + 10), 64)
    g = torch.Generator().manual_seed(m)
    h, delta = _input(m, k, dtype, seed=m + 1), torch.randn(m, k, generator=g).to(dtype)
    weight = (torch.rand(k, generator=g) + 0.5).to(dtype)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype)

    def step(hh):
        return (lin(NormInput(hh, delta, weight, 1e-5)), lin(hh), lin_down(SiluMulInput(gate_up)))

    # the team first: scratch an eager call left behind cannot stand in for rows it failed to make
    h_team = h.clone()
    sg = graph.StepGraph()
    out = sg.capture(lambda: step(h_team))
    assert sg._plan is not None and sg._plan.team_size == 2
    assert torch.equal(h_team, h)  # recording ran nothing
    for o in out:
        o.zero_()
    sg.replay()
    h_eager = h.clone()
    want = step(h_eager)
    assert torch.equal(h_team, h_eager)  # h += delta once, after both threads read h
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize("transform", [False, True])
def test_rope_in_a_team_equals_its_eager_call(two_threads, tokens, transform):
    # under 8 tokens thread 0 does it all while the other waits, from 8 they split the tokens
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    pos = torch.randint(0, 100, (tokens,), generator=g)
    angle = torch.arange(128)[:, None] * torch.rand(d, generator=g)
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    shift = torch.randn(kv_heads, d, generator=g) if transform else None
    rot = torch.linalg.qr(torch.randn(d, d, generator=g))[0].contiguous() if transform else None

    def step():
        return elementwise.qkv_rope(qkv, pos, cos, sin, heads, kv_heads, d, shift, rot)

    want = step()
    sg = graph.StepGraph()
    out = sg.capture(step)
    assert sg._plan.team_size == 2
    for o in out:
        o.zero_()
    sg.replay()
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_the_other_kernels_of_a_step_in_a_team_equal_their_eager_calls(two_threads, rows):
    # the INT8 and float linears, the row ops (split from 8 rows) and the
    # serial copies (thread 0 alone) in one team region
    g = torch.Generator().manual_seed(rows)
    k, n = 576, 1024
    h, delta = torch.randn(rows, k, generator=g), torch.randn(rows, k, generator=g)
    weight = torch.rand(k, generator=g) + 0.5
    w_float = torch.randn(n, k, generator=g).bfloat16()
    int8 = PackedInt8Gemm(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g),
                          torch.rand(n, generator=g) * 1e-3, None, torch.randn(n, generator=g))
    table, ids = torch.randn(50, k, generator=g), torch.randint(0, 50, (rows,), generator=g)

    def step(hh):
        x, _ = elementwise.add_rms_norm(hh, delta, weight, 1e-5)
        gate_up = float_linear.float_linear(x, w_float)
        return (x, gate_up, elementwise.silu_mul(gate_up), elementwise.rms_norm(hh, weight, 1e-5),
                elementwise.embed(ids, table), elementwise.concat_rows(x, hh),
                int8(hh) if fused_int8_available() else hh.clone())

    h_team = h.clone()  # the team first, as above
    sg = graph.StepGraph()
    out = sg.capture(lambda: step(h_team))
    assert sg._plan is not None and sg._plan.team_size == 2
    assert [getattr(fn, "team", None) for fn, _ in sg.ops].count(None) == 0  # one region: no call outside
    for o in out:
        o.zero_()
    sg.replay()
    h_eager = h.clone()
    want = step(h_eager)
    assert torch.equal(h_team, h_eager)
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("vocab", [2000, 49152, 1031])
def test_the_greedy_argmax_in_a_team_is_torchs_on_every_row(two_threads, vocab):
    # in a team each thread takes its share of every row's columns (units of
    # 64, as the LM head splits them) and thread 0 joins the shares: the
    # first maximum and the first NaN must be torch's whichever share holds them
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(9, vocab, generator=g)
    half = (vocab + 63) // 64 // 2 * 64  # where thread 1's share starts
    rows[1, [3, half + 5]] = 50.0  # a tie across the shares: the first one
    rows[2, [half + 1, half + 7]] = 50.0  # a tie within the second share
    rows[3, half + 2] = float("nan")  # a NaN in the second share beats a maximum in the first
    rows[3, 0] = 50.0
    rows[4, [10, half + 3]] = float("nan")  # the first NaN
    rows[5] = float("-inf")  # nothing but -inf: index 0
    rows[6, -1] = 50.0  # the last column
    rows[7, half - 1] = 50.0  # the last column of the first share
    sg = graph.StepGraph()
    out = sg.capture(lambda: elementwise.argmax(rows))
    assert sg._plan is not None and sg._plan.team_size == 2
    out.fill_(-1)
    sg.replay()
    assert out.tolist() == rows.argmax(-1).tolist()
    assert torch.equal(elementwise.argmax(rows), rows.argmax(-1))  # and its eager call


def test_a_team_region_that_gets_fewer_threads_than_asked_still_meets():
    # OMP_THREAD_LIMIT=1: the plan asks for a team of 2 and its region gets 1
    # thread; the barrier between calls counts the threads the region has
    # (counting 2 waited forever for a thread that does not exist)
    code = """
import torch
torch.set_num_threads(2)
from qoqserve.kernels.cpu import elementwise, graph
x, w = torch.randn(3, 5000), torch.ones(5000)
sg = graph.StepGraph()
top, y = sg.capture(lambda: (elementwise.argmax(x), elementwise.rms_norm(x, w, 1e-5)))
assert sg._plan is not None and sg._plan.team_size == 2
sg.replay()
assert torch.equal(top, x.argmax(-1))
print("done")
"""
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


def test_a_failing_call_stops_the_team_at_it(two_threads):
    lin = _packed(_checkpoint(1024, 576, 64, seed=0), 64)
    x = _input(1, 576, torch.float32, seed=1)
    sg = graph.StepGraph()
    first, second = sg.capture(lambda: (lin(x), lin(x)))
    assert sg._plan.team_size == 2
    (fn, args), later = sg.ops[0], sg.ops[1]
    bad = list(args)
    bad[-2] = type(args[-2])(99)  # a SIMD level no CPU has: -2 from every thread
    plan = replay.NativePlan([(fn, tuple(bad)), later])
    assert plan.team_size == 2
    first.zero_(), second.zero_()
    with pytest.raises(RuntimeError, match="w4a8_gemm"):
        plan.run()  # returns (no hang), naming the call
    assert not second.any()  # the call after it was not made
    sg.replay()  # the team is usable again
    assert torch.equal(first, lin(x)) and torch.equal(second, first)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_one_sequences_attention_splits_its_kv_heads_in_a_team(two_threads, isa, fmt):
    # one task (a context under one chunk): called on its own thread 0 does it
    # all; in a team the KV heads are split between the threads (1 and 2 of 3),
    # each head computed alone, so the bits of the eager call
    from qoqserve.layers import kv_cache as kc
    from qoqserve.layers.attention_backends import CpuAttention
    g = torch.Generator().manual_seed(3)
    hkv, d, bs, heads, n = 3, 64, 16, 9, 40
    layout = kc.Int4KVCacheLayout(hkv, d, bs) if fmt == "int4" else kc.DenseKVCacheLayout(hkv, d, bs, torch.bfloat16)
    attention = CpuAttention(layout)
    tables = torch.tensor([[2, 0, 3]])
    cache = layout.allocate(4, "cpu")
    pos = torch.arange(n)
    layout.write(cache, torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g),
                 tables[0, pos // bs] * bs + pos % bs)
    q, lens = torch.randn(1, heads, d, generator=g), torch.tensor([n])
    sg = graph.StepGraph()
    out = sg.capture(lambda: attention.decode(q, cache, tables, lens, d ** -0.5))
    assert sg._plan is not None and sg._plan.team_size == 2
    out.zero_()
    sg.replay()
    want = attention.decode(q, cache, tables, lens, d ** -0.5)
    assert want.abs().sum(-1).min() > 0  # every head has an output
    assert torch.equal(out, want)


def test_a_decode_step_on_a_team_equals_eager_on_every_split_path(qoq_tiny, two_threads, isa):
    # 16 sequences: the GEMMs share thread 0's quantized rows, RoPE (8+ tokens)
    # and the KV4 write (32+ heads x tokens) split their rows; prompts past
    # 256 tokens make attention tasks of several chunks and a merge pass. The
    # last ones decode in the smaller graphs, where those calls fall to thread 0
    prompts = [[(5 + 7 * i + j) % 250 + 3 for j in range(20 + 23 * i)] for i in range(16)]

    def outputs(**kw):
        llm = LLM(qoq_tiny, kv_cache_gb=0.1, dtype="float32", **kw)
        outs = llm.generate(prompts, GREEDY)
        captured = llm.engine.runner.captured
        teams = sorted({g._plan.team_size for g in captured.graphs.values()}) if captured else []
        del llm
        gc.collect()
        return [(o.token_ids, o.logprobs) for o in outs], teams

    eager, _ = outputs(enforce_eager=True)
    team, teams = outputs(capture_sizes="1,2,4,16")
    assert teams == [2]
    assert team == eager
