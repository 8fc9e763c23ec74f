"""The process groups of a tensor-parallel engine (torch.distributed).

Over the same ranks: the step group (NCCL on CUDA, gloo on CPU) carries the
all-reduces inside a step, with the short `timeout_s`, so a dead or stuck
rank turns into an error instead of a hang; a gloo group carries rank 0's
step broadcasts, with the short timeout on rank 0 and a long one on the
workers, which wait on it while the engine is idle. The default group only forms the world (ranks may take
minutes to load their shards). A rank that dies closes its sockets, so the
others see an error at their next collective well before any timeout.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qoqserve.layers.parallel import TensorParallel

# workers sit in the control broadcast between requests: an idle server is not a failure
_IDLE_TIMEOUT = datetime.timedelta(days=7)
# how long the ranks of a world may take to show up (torchrun: other nodes starting)
START_TIMEOUT_S = 600.0


@dataclass
class ParallelWorld:
    rank: int
    size: int
    tp: TensorParallel
    control: object  # gloo ProcessGroup for the step broadcasts

    def broadcast(self, msg=None):
        """Rank 0's msg, on every rank (rank 0 passes it, the others receive it)."""
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_int(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """This process is one rank of a torchrun (env://) world."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def join_world(rank: int, size: int, device: str, timeout_s: float,
               init_method: str | None = None) -> ParallelWorld:
    """Join (or with rank 0, form) the world of `size` ranks; init_method None:
    env:// (torchrun sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    if dist.is_initialized():  # torch.distributed has one default group per process
        raise RuntimeError("this process already runs a tensor-parallel engine: one per process "
                           "(shut the other down first)")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S)))
    if dist.get_world_size() != size:
        raise ValueError(f"the torchrun world has {dist.get_world_size()} ranks, but "
                         f"--tensor-parallel-size is {size}")
    step = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    # the timeout is each rank's own: rank 0 must not wait long on a worker that
    # stopped answering, a worker may wait as long as the server stays idle
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
                             if rank == 0 else _IDLE_TIMEOUT)
    return ParallelWorld(rank, size, TensorParallel(rank, size, step), control)
