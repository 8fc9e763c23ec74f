"""How many KV pages the pool gets: a budget in bytes (asked for, or a
fraction of free memory) over the bytes of one page in every layer."""
from __future__ import annotations

import torch

from qoqserve.config import CacheConfig
from qoqserve.layers.kv_cache import KVCacheLayout

_CPU_DEFAULT_KV_BYTES = 2 * 2**30


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_blocks_for_budget(cache: CacheConfig, layout: KVCacheLayout, num_layers: int,
                          device: torch.device) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_gb is not None:
        budget = cache.kv_cache_gb * 2**30
    else:
        budget = cache.kv_cache_fraction * available_memory_bytes(device)
        if device.type == "cpu":
            budget = min(budget, _CPU_DEFAULT_KV_BYTES)
    per_block = layout.bytes_per_token() * cache.block_size * num_layers
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"KV-cache budget of {budget / 2**20:.1f} MiB holds no page "
                         f"({per_block / 2**20:.2f} MiB each)")
    return blocks
