"""`qoqserve bench throughput`: QServe's protocol. For each precision, the
largest batch whose KV pages fit in what a memory budget leaves after the
weights; every request has input_len random prompt tokens and generates
exactly output_len tokens (EOS ignored); after a warm-up, throughput =
output tokens / wall time of the whole batch (prefill included).
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from qoqserve.bench.memory import plan_memory
from qoqserve.bench.offline import make_prompts
from qoqserve.bench.precisions import engine_kwargs, get_precision, model_for
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.quant.default_checkpoint import resolve_model
from qoqserve.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    precision: str
    model: str
    batch: int
    input_len: int
    output_len: int
    seconds: float
    output_tok_per_s: float
    weight_bytes: int           # as the engine holds them
    kv_bytes_per_token: int
    kv_budget_bytes: int
    note: str = ""


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_throughput(model: str | None, precisions: list[str], input_len: int = 1024,
                     output_len: int = 512, device: str = "cpu", memory_gb: float | None = None,
                     reserve_gb: float = 0.0, max_batch: int = 256, seed: int = 0,
                     tp: int = 1) -> list[ThroughputResult]:
    """tp: tensor-parallel ranks; memory_gb is then one rank's budget."""

    if memory_gb is None:
        if not device.startswith("cuda"):
            raise ValueError("give --memory-gb (the budget for weights + KV) on CPU")
        memory_gb = 0.9 * torch.cuda.get_device_properties(device).total_memory / 2**30
    results = []
    seq_len = input_len + output_len
    for name in precisions:
        p = get_precision(name)
        path = resolve_model(model_for(p, model))
        source = load_model_source(path)
        group = getattr(source.quant_config, "group_size", 128)
        plan = plan_memory(source.arch, p, device, seq_len, memory_bytes=int(memory_gb * 2**30),
                           reserve_bytes=int(reserve_gb * 2**30), group_size=group,
                           max_positions=seq_len, tp=tp, max_num_seqs=max_batch)
        batch = min(plan.max_concurrent_seqs, max_batch)
        if batch < 1:
            results.append(ThroughputResult(name, source.name, 0, input_len, output_len, 0.0, 0.0,
                                            plan.weight_bytes, plan.kv_bytes_per_token,
                                            plan.kv_budget_bytes, "does not fit"))
            print(f"{name:<14} does not fit in {memory_gb:.1f} GiB", flush=True)
            continue
        llm = LLM(path, kv_cache_gb=plan.kv_budget_bytes / 2**30, max_num_seqs=batch,
                  max_model_len=seq_len, seed=seed, tensor_parallel_size=tp, **engine_kwargs(p, device))
        vocab = llm.engine.arch.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(make_prompts(2, input_len, vocab, seed=seed + 999),
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        prompts = make_prompts(batch, input_len, vocab, seed=seed)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        produced = sum(len(o.token_ids) for o in outs)
        stats = llm.engine.stats()
        r = ThroughputResult(name, source.name, batch, input_len, output_len, seconds, produced / seconds,
                             stats["weight_bytes"], stats["kv_bytes_per_token"], plan.kv_budget_bytes)
        results.append(r)
        print(f"{name:<14} batch {batch:>4}: {r.output_tok_per_s:9.1f} output tok/s  ({seconds:.1f}s; "
              f"weights {r.weight_bytes / 2**30:.2f} GiB, KV {r.kv_bytes_per_token} B/token)", flush=True)
        llm.shutdown()
        del llm, outs
        _release(device)
    return results


def as_dicts(results) -> list[dict]:
    return [asdict(r) for r in results]
