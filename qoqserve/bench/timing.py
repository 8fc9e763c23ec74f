"""Wall-clock timing of a callable, the two ways the benchmarks use."""
from __future__ import annotations

import statistics
import time

import torch


def time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall time of fn() in milliseconds (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def fastest_call(fn, calls: int, warmup: int = 3, before=None) -> float:
    """Seconds of the fastest of `calls` single calls: on a shared machine a
    call only gets slower (preempted threads wait at OpenMP barriers for a
    time slice). before: run untimed ahead of each timed call (e.g. to push
    the call's data out of the caches)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(mib: int = 512, calls: int = 8) -> float:
    """Bytes/s one torch.sum streams over a tensor of `mib` MiB (well past the
    caches), the fastest of `calls`: the rate a memory-bound kernel can reach."""
    big = torch.ones(mib * 2**18)
    return big.numel() * 4 / fastest_call(big.sum, calls)


def best_of_rounds(fn, repeats: int, warmup: int = 1, rounds: int = 3) -> float:
    """Seconds per fn() call: the best of `rounds` rounds of `repeats` calls.
    The best round, not the mean: on a shared machine the noise only adds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def kernel_ms(fn, device: torch.device) -> float:
    """Median time of fn() in ms. On CUDA triton's do_bench: many calls back to
    back (host launch gaps hidden behind queued work) with the L2 cache
    flushed between them (weights come from HBM, as in a real model); on CPU
    (smoke tests only) plain wall time."""
    if device.type == "cuda":
        # lazy: Triton, only timed on CUDA
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return time_ms(fn, device, iters=1, warmup=0)
