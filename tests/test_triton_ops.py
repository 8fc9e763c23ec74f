"""The Triton kernels as torch custom ops (kernels/triton/ops.py): each op gives
its launcher's bits, passes torch.library.opcheck (schema, fake tensors,
declared mutation), and a compiled step that uses them (torch.compile,
fullgraph) keeps every one as one node and gives the eager step's result.
On CPU in Triton's interpreter (TRITON_INTERPRET=1, set in conftest)."""
from __future__ import annotations

import os

import pytest
import torch

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.triton import ops
from qoqserve.layers.kv_cache import Int4KVCacheLayout

DEVICE = os.environ.get("QOQSERVE_TEST_DEVICE", "cpu")
HKV, D, HEADS, BS = 2, 64, 4, 16


def _linear(n: int, k: int, group: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = qoq_ref.quantize_weight_group(torch.randn(n, k, generator=g) * 0.05, group)
    return {name: t.to(DEVICE) for name, t in
            dict(qweight=qoq_ref.pack_uint4(q.u), s1=q.s1.half(), s2=q.s2, zeros=q.z).items()}


def _pages(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    layout = Int4KVCacheLayout(HKV, D, BS)
    blocks = -(-tokens // BS) + 1
    cache = layout.allocate(blocks, "cpu")
    layout.write(cache, torch.randn(tokens, HKV, D, generator=g), torch.randn(tokens, HKV, D, generator=g),
                 torch.arange(tokens))
    tables = torch.arange(blocks - 1, dtype=torch.int32).view(1, -1)
    return cache.to(DEVICE), tables.to(DEVICE), torch.tensor([tokens], dtype=torch.int32, device=DEVICE)


def _cases():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 128, generator=g) * 3).to(DEVICE)
    w = _linear(96, 128, 64, 1)
    xq, sa, rs = ops.quant_int8(x)
    cache, tables, lens = _pages(40, 2)
    q = torch.randn(1, HEADS, D, generator=g).to(DEVICE)
    k, v = (torch.randn(3, HKV, D, generator=g).to(DEVICE) for _ in range(2))
    slots = torch.tensor([40, 41, 47], device=DEVICE)
    return {
        "triton_quant_int8": (ops.quant_int8_op, (x,)),
        "triton_rmsnorm_quant": (ops.rmsnorm_quant_op, (x, torch.rand(128, generator=g).to(DEVICE) + 0.5, 1e-6)),
        "triton_silu_mul_quant": (ops.silu_mul_quant_op, (torch.cat([x, -x], 1),)),
        "triton_w4a8_gemm": (ops.w4a8_gemm_op, (xq, sa, w["qweight"], w["s1"], w["zeros"], w["s2"], 64, rs, None,
                                                torch.float32)),
        "triton_kv4_write": (ops.kv4_write_op, (cache.clone(), k, v, slots)),
        "triton_kv4_decode": (ops.kv4_decode_op, (q, cache, tables, lens, D ** -0.5, 20, 3.0)),  # window, cap
    }


LAUNCHERS = {"triton_quant_int8": ops._quant_int8, "triton_rmsnorm_quant": ops._rmsnorm_quant,
             "triton_silu_mul_quant": ops._silu_mul_quant, "triton_kv4_decode": ops._kv4_decode}


@pytest.mark.parametrize("name", list(_cases()))
def test_each_op_gives_its_launchers_bits_and_passes_opcheck(name):
    op, args = _cases()[name]
    assert getattr(torch.ops.qoqserve, name).default._schema.name == f"qoqserve::{name}"
    if name == "triton_kv4_write":
        mine, theirs = args[0].clone(), args[0].clone()
        op(mine, *args[1:])
        ops._kv4_write(theirs, *args[1:])
        assert torch.equal(mine, theirs) and not torch.equal(mine, args[0])  # it wrote, in place
    elif name == "triton_w4a8_gemm":
        assert torch.equal(op(*args), ops._w4a8_gemm(*args[:-1], out_dtype=args[-1]))
    else:
        got, want = op(*args), LAUNCHERS[name](*args)
        assert all(torch.equal(a, b) for a, b in zip(got if isinstance(got, tuple) else [got],
                                                     want if isinstance(want, tuple) else [want]))
    # schema, fake tensors and the declared mutation (no autograd: inference kernels)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_a_compiled_step_keeps_each_kernel_as_one_node_and_matches_eager():
    w_qkv, w_o = _linear(HEADS * D + 2 * HKV * D, 128, 64, 3), _linear(128, HEADS * D, 64, 4)
    norm = torch.rand(128).to(DEVICE) + 0.5
    cache, tables, lens = _pages(40, 5)

    def step(h, cache, slots):
        """A decode step's attention block: norm + quant, qkv GEMM, KV4 write, decode, o GEMM."""
        xq, sa, rs = ops.rmsnorm_quant(h, norm, 1e-6)
        qkv = ops.w4a8_gemm(xq, sa, w_qkv["qweight"], w_qkv["s1"], w_qkv["zeros"], w_qkv["s2"], 64, rs, None,
                            torch.float32)
        q, k, v = qkv.split([HEADS * D, HKV * D, HKV * D], 1)
        ops.kv4_write(cache, k.reshape(-1, HKV, D), v.reshape(-1, HKV, D), slots)
        o = ops.kv4_decode_attention(q.reshape(-1, HEADS, D), cache, tables, lens + 1, D ** -0.5)
        oq, osa, ors = ops.quant_int8(o.reshape(1, -1))
        return h + ops.w4a8_gemm(oq, osa, w_o["qweight"], w_o["s1"], w_o["zeros"], w_o["s2"], 64, ors, None,
                                 torch.float32)

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    h = torch.randn(1, 128).to(DEVICE)
    slots = torch.tensor([40], device=DEVICE)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    want = step(h, eager_cache, slots)
    got = torch.compile(step, backend=backend, fullgraph=True)(h, compiled_cache, slots)
    assert torch.equal(got, want) and torch.equal(compiled_cache, eager_cache)
    kernels = sorted(t for t in seen if "qoqserve.triton_" in t)
    assert kernels == sorted(f"qoqserve.triton_{n}.default" for n in
                             ("rmsnorm_quant", "w4a8_gemm", "kv4_write", "kv4_decode", "quant_int8", "w4a8_gemm"))
