"""How many KV pages the pool gets: a budget in bytes (asked for, or a
fraction of free memory) over the bytes of one page in every layer; where
the sliding layers of a model have a pool of their own, what it leaves."""
from __future__ import annotations

import logging

import torch

from qoqserve.config import CacheConfig, EngineConfig
from qoqserve.engine.window_pages import window_pool_size
from qoqserve.layers.kv_cache import KVCacheLayout
from qoqserve.models.arch import ModelArchConfig

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


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> float:
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
    return budget


def pool_sizes(config: EngineConfig, layout: KVCacheLayout, arch: ModelArchConfig, device: torch.device,
               max_positions: int) -> tuple[int, int | None]:
    """(pages of the main pool, pages of the sliding layers' own pool or None).
    Where only some layers slide, they get a pool of their own the size of
    what running sequences can need of it (engine/window_pages.py) if that is
    smaller than the main one would be; the main pool gets the rest."""
    cache, sched = config.cache, config.scheduler
    per_layer = layout.bytes_per_token() * cache.block_size
    budget = None if cache.num_blocks is not None else kv_budget_bytes(cache, device)
    blocks = cache.num_blocks if budget is None else int(budget // (per_layer * arch.num_layers))
    if blocks < 1:
        raise ValueError(f"KV-cache budget of {budget / 2**20:.1f} MiB holds no page "
                         f"({per_layer * arch.num_layers / 2**20:.2f} MiB each)")
    if arch.sliding_window is None or not arch.sliding_layers or cache.disable_hybrid_kv_cache_manager:
        return blocks, None
    spec = config.speculative()
    lookahead = max(sched.num_scheduler_steps, spec.num_speculative_tokens if spec else 0)
    window = window_pool_size(arch.sliding_window, cache.block_size, sched.max_num_seqs,
                              sched.max_num_batched_tokens, lookahead, max_positions)
    if window >= blocks:
        return blocks, None
    if budget is not None:
        sliding = len(arch.sliding_layers)
        blocks = int((budget - window * per_layer * sliding) // (per_layer * (arch.num_layers - sliding)))
    return blocks, window
