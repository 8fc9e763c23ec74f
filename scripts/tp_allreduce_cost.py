"""What the whole-row activation scale would add per step (docs/parallel.md):
the latency of a max-all-reduce of one fp32 per token, next to the sum
all-reduce of [tokens, hidden] every row-parallel linear already does.
Two gloo ranks on this machine (NCCL on GPUs is another story: run it there).

    python scripts/tp_allreduce_cost.py [--hidden 576] [--tokens 1 16 256]
"""
from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(x: torch.Tensor, op, reps: int) -> float:
    for _ in range(5):
        dist.all_reduce(x, op=op)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x, op=op)
    return (time.perf_counter() - start) / reps


def _rank(rank: int, size: int, port: int, hidden: int, tokens: list[int], reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    for t in tokens:
        scale = _time(torch.ones(t), dist.ReduceOp.MAX, reps)
        rows = _time(torch.ones(t, hidden), dist.ReduceOp.SUM, reps)
        if rank == 0:
            print(f"| {t} | {scale * 1e6:.0f} | {rows * 1e6:.0f} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"gloo, {args.ranks} ranks, hidden {args.hidden}")
    print("| tokens | max-all-reduce of [tokens] fp32, us | sum-all-reduce of [tokens, hidden] fp32, us |")
    print("| --- | --- | --- |")
    mp.spawn(_rank, args=(args.ranks, port, args.hidden, args.tokens, args.reps), nprocs=args.ranks)


if __name__ == "__main__":
    main()
