"""The captured CPU decode step (engine/captured_step.py, kernels/cpu/graph.py)
and the C kernels it replays: replay equals op-by-op execution bit for bit,
padding rows change nothing, anything a replay would not repeat refuses to
be captured, and the per-token C ops and the LM head agree with torch."""
import gc

import pytest
import torch

from qoqserve.engine.captured_step import default_capture_sizes
from qoqserve.kernels.cpu import elementwise, float_linear, graph
from qoqserve.layers.key_transform import KeyTransform
from qoqserve.layers.norm import RMSNorm
from qoqserve.layers.rotary import RotaryEmbedding
from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

needs_c = pytest.mark.skipif(not (elementwise.available() and float_linear.available()),
                             reason="no C compiler")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)




@needs_c
@pytest.mark.parametrize("n", [300, 301])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_linear_is_batch_invariant_and_isa_independent(wdtype, n):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, 77, generator=g).to(wdtype)  # N, K not multiples of the tiles or lanes
    x = torch.randn(37, 77, generator=g)
    y = float_linear.float_linear(x, w)
    have = int(float_linear.load().float_linear_simd())
    for path in range(have + 1):  # the scalar loops and every vector path this CPU runs: same bits
        assert torch.equal(y, float_linear.float_linear(x, w, use_simd=path)), float_linear.PATHS[path]
    for rows in (slice(0, 1), slice(3, 5), slice(10, 33)):
        assert torch.equal(float_linear.float_linear(x[rows], w), y[rows])  # nothing depends on M
    long = torch.randn(600, 77, generator=g)  # a call of several row blocks
    y_long = float_linear.float_linear(long, w)
    for rows in (slice(250, 260), slice(599, 600)):
        assert torch.equal(float_linear.float_linear(long[rows], w), y_long[rows])
    ref = x.double() @ w.double().T
    assert (y.double() - ref).abs().max() < 1e-5 * ref.abs().max()


@needs_c
def test_float_linear_paths_follow_the_isa_cap(monkeypatch):
    have = int(float_linear.load().float_linear_simd())
    if have < 1:
        pytest.skip("this CPU has neither AVX2 + FMA nor AVX-512: only the scalar loops (tested above)")
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "scalar")
    assert float_linear.path() == "scalar"
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx2")
    assert float_linear.path() == "avx2"
    monkeypatch.delenv("QOQSERVE_CPU_ISA")
    assert float_linear.path() == float_linear.PATHS[have]
    if have < 2:
        with pytest.raises(RuntimeError, match="avx512"):
            float_linear.float_linear(torch.ones(2, 16), torch.ones(3, 16), use_simd=2)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="QOQSERVE_CPU_ISA"):
        float_linear.path()


def _qk_norms(head_dim, dtype, g):
    norms = tuple(RMSNorm(head_dim, 1e-6, dtype) for _ in range(2))
    for n in norms:
        n.weight.data = (1 + torch.randn(head_dim, generator=g)).to(dtype)
    return norms


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_token_ops_match_torch_and_are_row_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    ref, c = TorchTokenOps(), CpuTokenOps()
    t = 9
    x, d = (torch.randn(t, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype)
    # fp32: a different summation order in the norm; bf16: the same values after rounding
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def close(a, b):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item())

    close(c.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    (yc, hc), (yr, hr) = c.add_rms_norm(x.clone(), d, w, 1e-5), ref.add_rms_norm(x.clone(), d, w, 1e-5)
    close(yc, yr)
    assert torch.equal(hc, hr)
    gu = torch.randn(t, 2 * 40, generator=g).to(dtype) * 4
    close(c.silu_mul(gu), ref.silu_mul(gu))
    rope = RotaryEmbedding(16, 512, 1e4)
    kt = KeyTransform(2, 16, dtype)
    kt.shift.data = torch.randn(2, 16, generator=g).to(dtype)
    kt.rotation.data = torch.linalg.qr(torch.randn(16, 16, generator=g))[0].to(dtype).contiguous()
    qkv = torch.randn(t, (4 + 2 * 2) * 16, generator=g).to(dtype)
    pos = torch.randint(0, 500, (t,), generator=g)
    qk = _qk_norms(16, dtype, g)  # Qwen3's per-head norms before RoPE
    for transform in (None, kt):
        for norms in (None, qk):
            for a, b in zip(c.qkv_rope(qkv, pos, rope, transform, 4, 2, 16, norms),
                            ref.qkv_rope(qkv, pos, rope, transform, 4, 2, 16, norms)):
                close(a, b)
    for a, b in zip(c.qkv_rope(qkv, pos, None, kt, 4, 2, 16, qk), ref.qkv_rope(qkv, pos, None, kt, 4, 2, 16, qk)):
        close(a, b)  # a layer without RoPE (SmolLM3)
    plain = c.qkv_rope(qkv, pos, None, None, 4, 2, 16)
    assert torch.equal(plain[0].flatten(1), qkv[:, :64]) and torch.equal(plain[1].flatten(1), qkv[:, 64:96])
    normed = c.qkv_rope(qkv, pos, rope, kt, 4, 2, 16, qk)
    assert all((a - b).abs().max() > 0.1 for a, b in zip(normed[:2], c.qkv_rope(qkv, pos, rope, kt, 4, 2, 16)))
    assert all(torch.equal(a, b[3:4]) for a, b in zip(c.qkv_rope(qkv[3:4], pos[3:4], rope, kt, 4, 2, 16, qk),
                                                       normed))
    # each row alone gives the bits it gets in the batch
    assert torch.equal(c.rms_norm(x[4:5], w, 1e-5), c.rms_norm(x, w, 1e-5)[4:5])
    assert torch.equal(c.silu_mul(gu[2:3]), c.silu_mul(gu)[2:3])
    assert all(torch.equal(a, b[3:4]) for a, b in zip(c.qkv_rope(qkv[3:4], pos[3:4], rope, kt, 4, 2, 16),
                                                       c.qkv_rope(qkv, pos, rope, kt, 4, 2, 16)))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (64, 3, 3), (128, 5, 1), (32, 4, 2)])
def test_rope_with_the_key_transform_matches_torch_at_the_model_head_sizes(dtype, head_dim, heads, kv_heads):
    # the rotation runs on groups of heads at once where head_dim is 64 or 128
    # (groups of 4 and a remainder: 12, 6 and 6 heads here), one head at a
    # time elsewhere; every path sums each output in order by fused
    # multiply-adds, so a row's bits do not depend on its group or the batch
    g = torch.Generator().manual_seed(head_dim + heads)
    ref, c = TorchTokenOps(), CpuTokenOps()
    rope = RotaryEmbedding(head_dim, 512, 1e4)
    kt = KeyTransform(kv_heads, head_dim, dtype)
    kt.shift.data = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
    kt.rotation.data = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g))[0].to(dtype).contiguous()
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 500, (t,), generator=g)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = c.qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim)
    for a, b in zip(got, ref.qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim)):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item())
    qk = _qk_norms(head_dim, dtype, g)
    for a, b in zip(c.qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim, qk),
                    ref.qkv_rope(qkv, pos, rope, kt, heads, kv_heads, head_dim, qk)):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item())
    assert all(torch.equal(a[2:3], b) for a, b in zip(got, c.qkv_rope(qkv[2:3], pos[2:3], rope, kt, heads,
                                                                      kv_heads, head_dim)))


@needs_c
def test_step_graph_replays_on_new_inputs_and_rejects_torch_compute():
    w = torch.randn(64)
    buf = torch.randn(3, 64)

    def step(x):
        return elementwise.silu_mul(torch.cat([elementwise.rms_norm(x, w, 1e-6)] * 2, 1)
                                    if not graph.recording() else elementwise.rms_norm(x, w, 1e-6))

    g = graph.StepGraph()
    out = g.capture(lambda x: elementwise.rms_norm(x, w, 1e-6), buf)
    buf.copy_(torch.randn(3, 64))  # new inputs in the same buffer
    assert g.replay() is out
    assert torch.equal(out, elementwise.rms_norm(buf, w, 1e-6))
    with pytest.raises(graph.CaptureError, match="aten::"):
        graph.StepGraph().capture(lambda x: elementwise.rms_norm(x * 2, w, 1e-6), buf)
    assert not graph.recording()  # a failed capture leaves nothing on


def test_default_capture_sizes():
    assert default_capture_sizes(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(20)[-1] == 20


def _outputs(model, prompts, **kw):
    llm = LLM(model, kv_cache_gb=0.05, **kw)
    outs = llm.generate(prompts, GREEDY)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] and not llm.engine.has_unfinished()
    del llm
    gc.collect()
    return [(o.token_ids, o.logprobs) for o in outs], stats


@needs_c
def test_captured_decode_equals_eager_bit_for_bit(qoq_tiny):
    # five prompts of different lengths finish together: decode batches of 5
    # run padded in the size-8 graph, then alone in size 1
    prompts = [[5 + i * 7 + j for j in range(9 + 11 * i)] for i in range(5)]
    eager, s_eager = _outputs(qoq_tiny, prompts, dtype="float32", enforce_eager=True)
    captured, s_cap = _outputs(qoq_tiny, prompts, dtype="float32", capture_sizes="1,8")
    assert s_eager["captured_decode_sizes"] == [] and s_cap["captured_decode_sizes"] == [1, 8]
    assert captured == eager  # tokens and logprobs, exactly
    alone = [_outputs(qoq_tiny, [p], dtype="float32", capture_sizes="1,8")[0][0] for p in prompts[:2]]
    assert alone == captured[:2]  # a request alone (size 1) = padded among others (size 8)


@needs_c
def test_decode_graphs_place_their_buffers_in_one_arena(qoq_tiny):
    # every pointer a captured call gets into a buffer the recording made lands
    # in the shared arena, except into a graph's outputs; buffers not in use at
    # once share bytes, so the arena is far smaller than the buffers it replaces
    from qoqserve.kernels.cpu.buffer_plan import output_storages, storage_spans
    from qoqserve.kernels.cpu.replay import _bits, arg_code

    llm = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32", capture_sizes="1,8")
    llm.generate([[5, 6, 7, 8]], GREEDY)  # eager and captured paths equal elsewhere (bit_for_bit)
    cap = llm.engine.runner.captured
    lo = cap.arena.block.data_ptr()
    hi = lo + cap.arena.block.numel()
    for g in [*cap.graphs.values(), *cap.heads.values()]:
        kept = output_storages(g.output)
        spans = [s for s in storage_spans(g.buffers) if s[0] not in kept]
        if any(g is d for d in cap.graphs.values()):  # two layers here: a layer's buffers are free in the next
            assert cap.arena.block.numel() * 2 < sum(n for _, n in spans)
        for fn, args in g.ops:
            for t, a in zip(fn.argtypes, args):
                v = _bits("p", a) if arg_code(t) == "p" else 0
                assert not any(s <= v < s + n for s, n in spans), fn.__name__  # nothing left in a recorded buffer
    for g in cap.graphs.values():
        moved = [_bits("p", a) for fn, args in g.ops for t, a in zip(fn.argtypes, args) if arg_code(t) == "p"]
        assert sum(lo <= v < hi for v in moved) > len(g.ops)  # each call reads or writes the arena


@needs_c
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_float_linear_takes_bf16_rows_as_their_fp32_values(out_dtype):
    # bf16 rows are widened inside the kernel (no torch op around it), the
    # same sums as for their fp32 values, rounded to bf16 as torch rounds them
    g = torch.Generator().manual_seed(1)
    w = torch.randn(150, 333, generator=g).bfloat16()  # N, K off the tiles and lanes
    b = torch.randn(150, generator=g)
    have = int(float_linear.load().float_linear_simd())
    for m in (1, 2, 5, 37, 130):
        x = torch.randn(m, 333, generator=g).bfloat16()
        for path in range(have + 1):
            # the avx512-bf16 path sums bf16 x bf16 in its own order
            # (tests/test_float_linear_bf16.py); over fp32 weights it widens too
            for wt in (w, w.float()) if path < 3 else (w.float(),):
                want = float_linear.float_linear(x.float(), wt, b, use_simd=path).to(out_dtype)
                assert torch.equal(float_linear.float_linear(x, wt, b, use_simd=path, out_dtype=out_dtype), want)
    with pytest.raises(ValueError, match="fp32 outputs"):
        float_linear.float_linear(torch.randn(2, 333), w, out_dtype=torch.bfloat16)


@needs_c
def test_a_bf16_model_on_the_c_linears_captures_and_equals_eager(tmp_path, monkeypatch):
    # where torch has no fast bf16 GEMM (below AVX-512; forced here), or the C
    # kernel has bf16 dot products, a bf16 model's linears run the C kernel,
    # its queries the bf16 attention entry:
    # every call of the step is a C kernel, so it captures, head included
    from test_quant_pipeline import tiny_source

    from qoqserve.layers.quantization import fp
    monkeypatch.setattr(fp, "torch_has_fast_bf16_gemm", lambda: False)
    tiny_source("llama", tmp_path)  # saved as an HF dir
    path = str(tmp_path / "llama")
    prompts = [[5 + i * 7 + j for j in range(9 + 11 * i)] for i in range(5)]
    eager, s_eager = _outputs(path, prompts, dtype="bfloat16", enforce_eager=True)
    captured, s_cap = _outputs(path, prompts, dtype="bfloat16", capture_sizes="1,8")
    assert s_eager["captured_decode_sizes"] == [] and s_cap["captured_decode_sizes"] == [1, 8]
    assert "c-dense" in s_cap["linear_paths"] and s_cap["lm_head_kernel"] == "c"
    assert captured == eager  # tokens and logprobs, exactly
    alone = _outputs(path, prompts[:1], dtype="bfloat16", capture_sizes="1,8")[0]
    assert alone == captured[:1]  # size 1 alone = padded in size 8


@needs_c
def test_where_torchs_bf16_gemm_is_fast_bf16_decodes_of_two_rows_capture(tmp_path, monkeypatch):
    # AVX-512 hosts without BF16 dot products (forced here): calls of up to
    # BF16_C_MAX_ROWS rows take the C kernel, so decode steps of up to that
    # batch capture; larger ones and prefills run oneDNN op by op, in the eager
    # and the captured engine alike
    from test_quant_pipeline import tiny_source

    from qoqserve.layers.linear import Linear
    from qoqserve.layers.quantization import fp
    monkeypatch.setattr(fp, "torch_has_fast_bf16_gemm", lambda: True)
    if float_linear.load().float_linear_simd() >= 3:
        monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512")
    method = fp.CpuDenseLinearMethod()
    assert method.capture_rows(torch.bfloat16) == fp.BF16_C_MAX_ROWS == 2 and method.capture_rows(torch.float32) is None
    layer = Linear(64, [48], False, method, torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(layer(x[:2]), float_linear.float_linear(x[:2], layer.weight, out_dtype=torch.bfloat16))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    tiny_source("llama", tmp_path)
    path = str(tmp_path / "llama")
    prompts = [[5 + i * 7 + j for j in range(9 + 11 * i)] for i in range(3)]
    for batch in (prompts[:1], prompts[:2], prompts):
        eager, _ = _outputs(path, batch, dtype="bfloat16", enforce_eager=True)
        captured, stats = _outputs(path, batch, dtype="bfloat16", capture_sizes="1,2,8")
        assert stats["captured_decode_sizes"] == [1, 2] and captured == eager


@needs_c
def test_captured_full_precision_fp32_equals_eager(tmp_path):
    # fp32 linears run the C dense kernel and dense pages the C row copy: captured too
    from test_quant_pipeline import tiny_source
    tiny_source("llama", tmp_path)  # saved as an HF dir
    path = str(tmp_path / "llama")
    prompts = [[5 + i * 3 + j for j in range(7 + 5 * i)] for i in range(3)]
    eager, _ = _outputs(path, prompts, dtype="float32", enforce_eager=True)
    captured, stats = _outputs(path, prompts, dtype="float32", capture_sizes="1,2,4")
    assert stats["captured_decode_sizes"] == [1, 2, 4] and "c-dense" in stats["linear_paths"]
    assert captured == eager


@needs_c
@pytest.mark.parametrize("kw", [{"w4a8_backend": "torch-int8"}, {"w4a8_backend": "packed"}])
def test_every_int8_kernel_replays(qoq_tiny, kw):
    # a kernel call the graph did not record would be skipped by every replay
    prompts = [[5 + i * 3 + j for j in range(7 + 5 * i)] for i in range(3)]
    eager, _ = _outputs(qoq_tiny, prompts, dtype="float32", enforce_eager=True, **kw)
    captured, stats = _outputs(qoq_tiny, prompts, dtype="float32", capture_sizes="1,2,4", **kw)
    assert stats["captured_decode_sizes"] == [1, 2, 4]
    assert captured == eager


@needs_c
def test_w8a8_quantized_at_load_replays(tmp_path):
    from test_quant_pipeline import tiny_source
    tiny_source("llama", tmp_path)
    path = str(tmp_path / "llama")
    prompts = [[5 + i * 3 + j for j in range(7 + 5 * i)] for i in range(3)]
    eager, _ = _outputs(path, prompts, dtype="float32", quantization="w8a8", enforce_eager=True)
    captured, stats = _outputs(path, prompts, dtype="float32", quantization="w8a8", capture_sizes="1,2,4")
    assert stats["captured_decode_sizes"] == [1, 2, 4] and captured == eager


@needs_c
def test_the_lm_head_is_captured_per_row_count_or_runs_after_the_replay(qoq_tiny, monkeypatch):
    # where the head records, one graph per row count computes the real rows'
    # logits only; where it does not, the head runs op by op after each replay
    from qoqserve.models.llama import LlamaForCausalLM
    prompts = [[5 + i * 3 + j for j in range(7 + 5 * i)] for i in range(3)]
    eager, _ = _outputs(qoq_tiny, prompts, dtype="float32", enforce_eager=True)
    llm = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32", capture_sizes="1,2,4")
    captured = llm.engine.runner.captured
    vocab = llm.engine.arch.vocab_size
    assert captured.with_head and sorted(captured.heads) == [1, 4]  # the others when first needed
    assert [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)] == eager
    assert sorted(captured.heads) == [1, 3, 4]  # the prompts decode together to the end
    logits, greedy = captured.heads[3].output
    assert logits.shape == (3, vocab) and greedy.shape == (3,)  # 3 rows run in the size-4 graph: no padded row
    assert logits.data_ptr() == captured.heads[4].output[0].data_ptr()  # one buffer
    # each row's greedy token, computed in the step, is the argmax of the step's
    # logits (the last step ran 3 rows: their buffers hold it)
    logits, greedy = captured.heads[3].output
    assert torch.equal(greedy, logits.argmax(-1))
    del llm
    gc.collect()
    head = LlamaForCausalLM.compute_logits
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", lambda self, h: head(self, h) * 1.0)  # a torch op
    llm = LLM(qoq_tiny, kv_cache_gb=0.05, dtype="float32", capture_sizes="1,2,4")
    captured = llm.engine.runner.captured
    assert captured is not None and not captured.with_head and not captured.heads
    assert sorted(captured.graphs) == [1, 2, 4]
    assert [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)] == eager


@needs_c
def test_a_model_that_cannot_be_captured_runs_op_by_op(qoq_tiny):
    # the sim method computes with torch ops: capture refuses, steps still run
    outs, stats = _outputs(qoq_tiny, [[5, 6, 7, 8]], dtype="float32", w4a8_backend="sim")
    assert stats["captured_decode_sizes"] == [] and len(outs[0][0]) == GREEDY.max_tokens


@needs_c
def test_a_kernel_refusing_its_arguments_at_capture_leaves_steps_op_by_op(qoq_tiny, monkeypatch):
    # recording runs no kernel; the check replay after capture must catch a
    # kernel that fails (here: the first one recorded) before a served step does
    launch = graph.launch

    def refuse(*args):
        return -2

    def first_recorded_refuses(fn, *args):
        if graph.recording() and not graph._recording.ops:
            fn = refuse
        return launch(fn, *args)

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    eager, _ = _outputs(qoq_tiny, prompts, dtype="float32", enforce_eager=True)
    monkeypatch.setattr(graph, "launch", first_recorded_refuses)
    outs, stats = _outputs(qoq_tiny, prompts, dtype="float32", capture_sizes="1,2")
    assert stats["captured_decode_sizes"] == []
    assert outs == eager


@needs_c
def test_a_captured_graph_replays_natively_with_the_eager_results():
    """Captured calls run as one native plan (replay.c) where it builds; its
    outputs equal the eager calls', and a kernel returning nonzero is named."""
    import ctypes

    from qoqserve.kernels.cpu import replay
    if replay.load() is None:
        pytest.fail("replay.c must build where the other kernels do (libffi)")
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 33, generator=g).bfloat16(), torch.randn(5, 33, generator=g)
    sg = graph.StepGraph()
    out = sg.capture(lambda: elementwise.silu_mul(float_linear.float_linear(x, w)))
    assert sg._plan is not None  # the native plan, not the Python loop
    out.zero_()  # recording computed nothing: the replay writes every value
    assert torch.equal(sg.replay(), elementwise.silu_mul(float_linear.float_linear(x, w)))
    libc_abs = ctypes.CDLL(None).abs
    libc_abs.argtypes, libc_abs.restype = [ctypes.c_int], ctypes.c_int
    bad = replay.NativePlan([(libc_abs, (0,)), (libc_abs, (-3,))])  # abs(-3) = 3: "failed"
    with pytest.raises(RuntimeError, match="abs"):
        bad.run()
    odd = ctypes.CDLL(None).abs
    odd.argtypes, odd.restype = [ctypes.c_char], ctypes.c_int
    with pytest.raises(ValueError):  # an argument type it cannot encode: graph.py replays in Python
        replay.NativePlan([(odd, (b"a",))])


def test_capture_sizes_are_validated():
    from qoqserve.config import EngineConfig
    assert EngineConfig(capture_sizes="8, 1,4").capture_size_list() == [1, 4, 8]
    for bad in ("0,2", "a", ""):
        with pytest.raises(ValueError, match="capture_sizes"):
            EngineConfig(capture_sizes=bad).capture_size_list()


@needs_c
def test_c_kernels_are_torch_custom_ops_with_fake_implementations():
    from qoqserve.kernels.cpu import kv4_write, paged_decode, w4a8_gemm
    from qoqserve.kernels.qoq_ref import pack_uint4
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g).to(torch.bfloat16)
    torch.library.opcheck(float_linear.float_linear_op, (x, w))
    n, k, gs = 32, 64, 32
    codes = w4a8_gemm.repack_codes(pack_uint4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)))
    gp = w4a8_gemm.pack_group_params(torch.ones(n, k // gs, dtype=torch.uint8),
                                     torch.full((n, k // gs), 8, dtype=torch.uint8))
    torch.library.opcheck(w4a8_gemm.w4a8_gemm_op, (x, codes, gp, gs, n, torch.rand(n, generator=g),
                                                   None, None, w4a8_gemm.simd_level()))
    cache = torch.zeros(2, 16, 2, 2, 16 // 2 + 4, dtype=torch.uint8)
    kk, vv = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    torch.library.opcheck(kv4_write.kv4_write_op, (cache, kk, vv, torch.tensor([0, 1, 17])))
    rows = cache.view(-1, 2, 2, 12)
    torch.library.opcheck(paged_decode.paged_decode_op,
                          (torch.randn(2, 4, 16, generator=g), rows[:, 0], rows[:, 1], "int4", 16,
                           torch.tensor([[0, 1], [1, 0]]), torch.tensor([3, 18]), 0.25, 5, 3.0))  # window, cap
    from qoqserve.kernels.cpu import paged_prefill
    torch.library.opcheck(paged_prefill.paged_prefill_op,
                          (torch.randn(5, 4, 16, generator=g), rows[:, 0], rows[:, 1], "int4", 16,
                           torch.tensor([[0, 1], [1, 0]]), torch.tensor([0, 3, 5]), torch.tensor([0, 16]), 0.25, 5,
                           3.0))


@needs_c
@pytest.mark.parametrize("has_bias", [False, True])
def test_bf16_linears_on_the_c_kernel_are_torchs_within_bf16_rounding_and_batch_invariant(has_bias):
    """Where torch's bf16 GEMM is slow (below AVX-512) bf16 linears run the C
    kernel over the bf16 weights; forced on here so every CPU checks it."""
    from qoqserve.layers.linear import Linear
    from qoqserve.layers.quantization.fp import CpuDenseLinearMethod

    torch.manual_seed(0)
    c_method = CpuDenseLinearMethod(bf16_on_c=True)
    layer = Linear(96, [40, 24], has_bias, c_method, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn_like(layer.weight, dtype=torch.float32))
        if has_bias:
            layer.bias.copy_(torch.randn_like(layer.bias, dtype=torch.float32))
    c_method.process_weights_after_loading(layer)
    x = torch.randn(37, 96).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 64)
    exact = x.double() @ layer.weight.double().t() + (layer.bias.double() if has_bias else 0)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias if has_bias else None)
    # both are the exact sum rounded to bf16 after fp32 sums: within 1 bf16 ulp (2^-8 relative) of it
    for y in (got, ref):
        assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-2).all()
    for m in (1, 5, 12):  # a row's result does not depend on how many rows came with it
        assert torch.equal(layer(x[:m]), got[:m])
    bias = layer.bias.float() if has_bias else None
    assert torch.equal(got, float_linear.float_linear(x, layer.weight, bias).bfloat16())  # the C kernel ran
    torch_method = CpuDenseLinearMethod(bf16_on_c=False)
    assert torch.equal(torch_method.apply(layer, x), ref)  # where torch's bf16 GEMM is fast: it


@needs_c
def test_recording_a_step_does_not_import_dynamo():
    """The recording guard is a TorchDispatchMode, which torch would wrap in
    torch._dynamo.disable: importing dynamo on its first call, seconds of every
    engine's start. A fresh process builds a captured engine without it."""
    import subprocess
    import sys

    code = ("import sys; from qoqserve.llm import LLM; "
            "llm = LLM(None, dtype='float32', kv_cache_gb=0.02, max_num_seqs=2); "
            "print(llm.engine.stats()['captured_decode_sizes'], 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[1, 2] False", out.stdout + out.stderr
