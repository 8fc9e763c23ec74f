"""How many KV pages the pool gets (engine/kv_budget.py), for each way of
asking: pages, GiB, a fraction of free memory, or vLLM's share of the GPU."""
import logging

import pytest
import torch

from qoqserve.config import CacheConfig
from qoqserve.engine.kv_budget import num_blocks_for_budget
from qoqserve.layers.kv_cache import Int4KVCacheLayout

LAYOUT = Int4KVCacheLayout(8, 128, 16)  # Llama-3-8B's KV heads: 2 x 8 x 68 bytes a token and layer
PER_BLOCK = LAYOUT.bytes_per_token() * 16 * 32
GIB = 2**30


def _gpu(monkeypatch, free, total):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_gpu_memory_utilization_leaves_what_the_gpu_already_holds(monkeypatch):
    # an 80 GiB GPU holding 16 GiB of weights: at 0.9 the engine may fill 72 GiB, so 56 for KV
    _gpu(monkeypatch, 64 * GIB, 80 * GIB)
    blocks = num_blocks_for_budget(CacheConfig(gpu_memory_utilization=0.9), LAYOUT, 32, torch.device("cuda"))
    assert blocks == int((0.9 * 80 - 16) * GIB // PER_BLOCK)
    # the default (no share asked for): a fraction of what is free
    assert num_blocks_for_budget(CacheConfig(), LAYOUT, 32, torch.device("cuda")) == int(0.3 * 64 * GIB // PER_BLOCK)
    assert num_blocks_for_budget(CacheConfig(gpu_memory_utilization=0.9, kv_cache_gb=1.0), LAYOUT, 32,
                                 torch.device("cuda")) == GIB // PER_BLOCK  # GiB asked for win


def test_a_share_the_gpu_already_exceeds_or_out_of_range_is_refused(monkeypatch):
    _gpu(monkeypatch, 20 * GIB, 80 * GIB)  # 60 GiB held
    with pytest.raises(ValueError, match="already holds 60.0 of its 80.0 GiB"):
        num_blocks_for_budget(CacheConfig(gpu_memory_utilization=0.5), LAYOUT, 32, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        num_blocks_for_budget(CacheConfig(gpu_memory_utilization=1.5), LAYOUT, 32, torch.device("cuda"))


def test_on_cpu_the_share_is_said_to_be_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="qoqserve.engine.kv_budget"):
        blocks = num_blocks_for_budget(CacheConfig(gpu_memory_utilization=0.9, kv_cache_fraction=0.01), LAYOUT, 32,
                                       torch.device("cpu"))
    assert blocks >= 1 and "applies to CUDA devices" in caplog.text
