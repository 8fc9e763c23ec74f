"""How many KV pages the pool gets: a budget in bytes (asked for, or a
fraction of free memory) over the bytes of one page in every layer."""
from __future__ import annotations

import logging

import torch

from qoqserve.config import CacheConfig
from qoqserve.layers.kv_cache import KVCacheLayout

_CPU_DEFAULT_KV_BYTES = 2 * 2**30
log = logging.getLogger(__name__)


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
    util = cache.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if cache.kv_cache_gb is not None:
        budget = cache.kv_cache_gb * 2**30
    elif util is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = util * total - (total - free)  # what the GPU holds now counts against the share
        if budget <= 0:
            raise ValueError(f"--gpu-memory-utilization {util}: the GPU already holds "
                             f"{(total - free) / 2**30:.1f} of its {total / 2**30:.1f} GiB (weights, other "
                             f"processes), more than {util:.0%} of it: no room is left for KV pages")
    else:
        if util is not None:
            log.warning("--gpu-memory-utilization applies to CUDA devices; on %s the KV pool is "
                        "--kv-cache-fraction (%.2f) of free memory", device.type, cache.kv_cache_fraction)
        budget = cache.kv_cache_fraction * available_memory_bytes(device)
        if device.type == "cpu":
            budget = min(budget, _CPU_DEFAULT_KV_BYTES)
    per_block = layout.bytes_per_token() * cache.block_size * num_layers
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"KV-cache budget of {budget / 2**20:.1f} MiB holds no page "
                         f"({per_block / 2**20:.2f} MiB each)")
    return blocks
