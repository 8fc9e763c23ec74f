"""How many KV pages the pool gets (engine/kv_budget.py), for each way of
asking: pages, GiB, a fraction of free memory, or vLLM's share of the GPU;
and, where only some layers slide, the sliding layers' own pool."""
import logging

import pytest
import torch

from qoqserve.config import CacheConfig, EngineConfig, SchedulerConfig
from qoqserve.engine import kv_budget
from qoqserve.engine.window_pages import window_span_blocks
from qoqserve.layers.kv_cache import Int4KVCacheLayout
from qoqserve.model_loader.synthetic import synthetic_arch

LAYOUT = Int4KVCacheLayout(8, 128, 16)  # Llama-3-8B's KV heads: 2 x 8 x 68 bytes a token and layer
PER_BLOCK = LAYOUT.bytes_per_token() * 16 * 32
GIB = 2**30
LLAMA_3_8B = synthetic_arch("llama-3-8b")


def pool_sizes(cache: CacheConfig, layout, layers: int, device, arch=LLAMA_3_8B, **sched):
    assert layers == arch.num_layers
    return kv_budget.pool_sizes(EngineConfig(cache=cache, scheduler=SchedulerConfig(**sched)), layout, arch,
                                device, 8192)


def _gpu(monkeypatch, free, total):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_gpu_memory_utilization_leaves_what_the_gpu_already_holds(monkeypatch):
    # an 80 GiB GPU holding 16 GiB of weights: at 0.9 the engine may fill 72 GiB, so 56 for KV
    _gpu(monkeypatch, 64 * GIB, 80 * GIB)
    blocks = pool_sizes(CacheConfig(gpu_memory_utilization=0.9), LAYOUT, 32, torch.device("cuda"))[0]
    assert blocks == int((0.9 * 80 - 16) * GIB // PER_BLOCK)
    # the default (no share asked for): a fraction of what is free
    assert pool_sizes(CacheConfig(), LAYOUT, 32, torch.device("cuda"))[0] == int(0.3 * 64 * GIB // PER_BLOCK)
    assert pool_sizes(CacheConfig(gpu_memory_utilization=0.9, kv_cache_gb=1.0), LAYOUT, 32,
                      torch.device("cuda")) == (GIB // PER_BLOCK, None)  # GiB asked for win


def test_a_share_the_gpu_already_exceeds_or_out_of_range_is_refused(monkeypatch):
    _gpu(monkeypatch, 20 * GIB, 80 * GIB)  # 60 GiB held
    with pytest.raises(ValueError, match="already holds 60.0 of its 80.0 GiB"):
        pool_sizes(CacheConfig(gpu_memory_utilization=0.5), LAYOUT, 32, torch.device("cuda"))[0]
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        pool_sizes(CacheConfig(gpu_memory_utilization=1.5), LAYOUT, 32, torch.device("cuda"))[0]


def test_on_cpu_the_share_is_said_to_be_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="qoqserve.engine.kv_budget"):
        blocks, _ = pool_sizes(CacheConfig(gpu_memory_utilization=0.9, kv_cache_fraction=0.01), LAYOUT, 32,
                               torch.device("cpu"))
    assert blocks >= 1 and "applies to CUDA devices" in caplog.text


def test_the_sliding_layers_get_a_pool_the_size_of_their_windows():
    arch = synthetic_arch("gemma-3-1b")  # 26 layers, 22 sliding over 512 positions, one KV head of 256
    layout = Int4KVCacheLayout(1, 256, 16)
    per_layer = layout.bytes_per_token() * 16
    cache = CacheConfig(kv_cache_gb=1.0)
    blocks, window = pool_sizes(cache, layout, 26, torch.device("cpu"), arch, max_num_seqs=8,
                                max_num_batched_tokens=512)
    # each of 8 sequences: its window's span, a burst's page and the one being filled, and
    # a finished one's last window kept for prefix hits; a step's chunks
    assert window == 8 * (2 * window_span_blocks(512, 16) + 2) + 512 // 16
    # the main pool holds the 4 global layers with the rest of the budget
    assert blocks == int((GIB - window * per_layer * 22) // (per_layer * 4))
    assert blocks * 4 + window * 22 <= GIB // per_layer
    alone = GIB // (per_layer * 26)
    assert blocks > 5 * alone  # a 5.6x longer context, all in all, than one pool for every layer
    # turned off, or where every sequence's windows would not fit in less: one pool as before
    assert pool_sizes(CacheConfig(kv_cache_gb=1.0, disable_hybrid_kv_cache_manager=True), layout, 26,
                      torch.device("cpu"), arch, max_num_seqs=8) == (alone, None)
    assert pool_sizes(CacheConfig(kv_cache_gb=0.01), layout, 26, torch.device("cpu"), arch,
                      max_num_seqs=8)[1] is None
    # pages asked for: the main pool has them, the sliding layers' pool what it needs
    assert pool_sizes(CacheConfig(num_blocks=4096), layout, 26, torch.device("cpu"), arch,
                      max_num_seqs=8, max_num_batched_tokens=512) == (4096, window)
