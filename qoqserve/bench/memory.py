"""`qoqserve bench memory`: what a model costs in memory at each precision.

Weight bytes are computed from the shapes and the resident format of each
linear method (the tests check them against what the engine really holds);
KV bytes per token come from the KV layout classes themselves. Under a total
memory budget, the KV pool is what the weights and a reserve leave, split as
the engine splits it (engine/kv_budget.py: where only some layers slide,
they get a pool the size of their windows), and the concurrent-sequence
count follows from the pages one sequence needs.

With tensor parallelism (`-tp N`) every number is per rank: each rank holds
its slice of every linear and the KV pages of its own KV heads, and the
embeddings, norms and LM head whole (docs/parallel.md); the budget is one
device's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import torch

from qoqserve.bench.precisions import Precision
from qoqserve.config import CacheConfig, EngineConfig, SchedulerConfig, parse_dtype
from qoqserve.engine.backends import kernel_choice, kv_layout, logits_head
from qoqserve.engine.kv_budget import pool_sizes
from qoqserve.layers.parallel import TensorParallel
from qoqserve.layers.quantization import QoQConfig, UnquantizedConfig, W8A8Config
from qoqserve.model_loader.schema import linear_shapes
from qoqserve.models.arch import ModelArchConfig


@dataclass
class MemoryPlan:
    precision: str
    weight_bytes: int
    linear_weight_bytes: int
    kv_bytes_per_token: int      # layers that keep every page (all but sliding ones with a pool), K and V, metadata
    kv_budget_bytes: int
    num_pages: int
    block_size: int
    seq_len: int
    max_concurrent_seqs: int
    tensor_parallel_size: int = 1
    # the sliding-window layers' own pool, where they have one (engine/window_pages.py)
    window_kv_bytes_per_token: int = 0
    num_window_pages: int | None = None


def linear_bytes(n: int, k: int, weights: str, group_size: int, storage: str, elem: int) -> int:
    """Resident bytes of one [n, k] linear (bias excluded). storage: "packed4"
    (UINT4 codes: the GPU GEMM, the per-call expansion), "int8" (INT8 operand
    for torch._int_mm), "vnni" (the fused CPU kernel's padded INT8 layout,
    with fp32 s1 and, per channel, fp32 z*s1; nothing else kept) or "w4vnni"
    (the packed CPU W4A8 kernel: padded 4-bit codes, 1 byte per channel and
    group, fp32 s1 and per channel z*s1)."""
    if weights == "fp":
        return n * k * elem
    if storage == "w4vnni":
        if weights != "qoq":
            storage = "vnni"  # W8A8 keeps the fused INT8 layout
        else:
            np_ = -(-n // 16) * 16
            codes = np_ * (-(-k // 8) * 8) // 2
            return codes + (np_ * (k // group_size) if group_size else 0) + 4 * n * (1 if group_size else 2)
    if storage == "vnni":
        per_channel = weights == "qoq" and not group_size
        return -(-n // 16) * 16 * (-(-k // 4) * 4) + 4 * n * (2 if per_channel else 1)
    if weights == "w8a8":
        return n * k + n * 4                       # int8 weight + fp32 scale per row
    codes = n * k // 2 if storage == "packed4" else n * k
    meta = n * 2 + (2 * n * (k // group_size) if group_size else n)  # s1 fp16; s2+zeros or zeros
    return codes + meta


def head_keeps_own_copy(p: Precision, device: str, dtype: torch.dtype, group_size: int) -> bool:
    """Whether the engine's default LM head (engine/backends.py) computes from
    a copy of its own, so that the model's untied lm_head is released
    (LlamaForCausalLM.release_lm_head): the INT8 head of QoQ on CPU."""
    quant = {"qoq": lambda: QoQConfig(group_size), "w8a8": W8A8Config}.get(p.weights, UnquantizedConfig)()
    choice = kernel_choice(EngineConfig(device=device))
    return logits_head("auto", choice, choice.cpu_ops and device == "cpu", dtype, quant).own_copy_only


def linear_storage(device: str) -> str:
    """How INT8 linears keep their weights with the engine's default backends on
    this device (engine/backends.py; see linear_bytes)."""
    choice = kernel_choice(EngineConfig(device=device))
    if choice.w4a8 == "triton":
        return "packed4"  # the Triton GEMM reads packed codes
    if choice.w4a8 == "packed":
        return "w4vnni"  # QoQ only; W8A8 keeps the fused INT8 layout ("vnni") there
    return "vnni" if choice.fused_int8 else "int8"


def plan_memory(arch: ModelArchConfig, p: Precision, device: str, seq_len: int,
                budget_bytes: int | None = None, memory_bytes: int | None = None,
                reserve_bytes: int = 0, group_size: int = 128, block_size: int = 16,
                max_positions: int | None = None, tp: int = 1, max_num_seqs: int | None = None) -> MemoryPlan:
    """max_num_seqs: the engine's (default: its default), which sizes the
    sliding layers' own pool where only some layers slide."""

    dtype = parse_dtype(p.dtype, device)
    elem = torch.empty((), dtype=dtype).element_size()
    storage = linear_storage(device)
    rank = TensorParallel(0, tp)
    lin = sum(linear_bytes(n, k, p.weights, group_size, storage, elem)
              for n, k in linear_shapes(arch, rank).values())
    local = dataclasses.replace(arch, num_heads=arch.num_heads // tp,
                                num_kv_heads=rank.kv_heads(arch.num_kv_heads, arch.num_heads)[1])
    if arch.attention_bias:  # the fused kernel keeps its own fp32 copy instead
        bias_elem = 4 if storage in ("vnni", "w4vnni") and p.weights != "fp" else elem
        lin += arch.num_layers * (local.num_heads + 2 * local.num_kv_heads) * arch.head_dim * bias_elem
    released = head_keeps_own_copy(p, device, dtype, group_size)
    embed = arch.vocab_size * arch.hidden_size * elem * (1 if arch.tie_word_embeddings or released else 2)
    norms = ((4 if arch.sandwich_norms else 2) * arch.num_layers + 1) * arch.hidden_size * elem
    if arch.qk_norm:  # Qwen3's and Gemma's q and k norms, one weight per channel of a head
        norms += 2 * arch.num_layers * arch.head_dim * elem
    # the fp32 RoPE cos/sin tables of every position the engine allows (Gemma 3: two, global and local)
    rope = 2 * (max_positions or arch.max_position_embeddings) * (arch.rotary_dim or arch.head_dim) * 4
    rope *= 2 if arch.rope_local_theta else 1
    weights = lin + embed + norms + rope
    kv_kind = {"16bit": "float16" if device.startswith("cuda") else "bfloat16", "auto": "auto"}.get(p.kv, p.kv)
    kv_format = "int4" if (p.weights == "qoq" and kv_kind == "auto") else None
    layout = kv_layout(local, CacheConfig(block_size=block_size, kv_cache_dtype=kv_kind), dtype,
                       device, kv_format)
    if budget_bytes is None:
        if memory_bytes is None:
            raise ValueError("give a KV budget or a total memory budget")
        budget_bytes = max(memory_bytes - weights - reserve_bytes, 0)
    # the engine's own split (engine/kv_budget.py)
    sched = SchedulerConfig(**({"max_num_seqs": max_num_seqs} if max_num_seqs else {}))
    config = EngineConfig(device=device, scheduler=sched,
                          cache=CacheConfig(block_size=block_size, kv_cache_gb=budget_bytes / 2**30))
    try:
        pages, window_pages = pool_sizes(config, layout, local, torch.device("meta"),
                                         max_positions or arch.max_position_embeddings)
    except ValueError:  # not one page in the budget: nothing fits
        pages, window_pages = 0, None
    sliding = len(arch.sliding_layers) if window_pages is not None else 0
    seqs = pages // math.ceil(seq_len / block_size)
    if window_pages is not None:  # that pool is sized for the engine's most sequences
        seqs = min(seqs, sched.max_num_seqs)
    return MemoryPlan(p.name, weights, lin, layout.bytes_per_token() * (arch.num_layers - sliding), budget_bytes,
                      pages, block_size, seq_len, seqs, tp, layout.bytes_per_token() * sliding, window_pages)


def as_dicts(plans) -> list[dict]:
    return [asdict(x) for x in plans]


def format_plans(plans: list[MemoryPlan]) -> str:
    per_rank = any(x.tensor_parallel_size > 1 for x in plans)
    head = " (per rank)" if per_rank else ""
    window = any(x.num_window_pages is not None for x in plans)
    cols = ["precision", "tp", f"weights GiB{head}", f"KV bytes/token{head}", f"KV budget GiB{head}", "pages",
            "max seqs"] + (["sliding layers' KV bytes/token", "their pages"] if window else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for x in plans:
        row = [x.precision, x.tensor_parallel_size, f"{x.weight_bytes / 2**30:.3f}", x.kv_bytes_per_token,
               f"{x.kv_budget_bytes / 2**30:.2f}", x.num_pages, x.max_concurrent_seqs]
        row += [x.window_kv_bytes_per_token, x.num_window_pages or "-"] if window else []
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)
