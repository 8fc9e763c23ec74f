"""Tensor parallelism as the layers see it: this rank's slice of the heads and
of the MLP, and the one collective a row-parallel linear ends in.

Megatron's split (docs/parallel.md): qkv and gate_up are column parallel
(each rank computes its heads' / its intermediate channels' outputs), o_proj
and down_proj row parallel (each rank multiplies its slice of the input and
the partial sums are all-reduced). KV heads are split like query heads; when
there are fewer KV heads than ranks each rank keeps the one its query heads
use (replicated, as vLLM does). Embeddings, norms and the LM head are whole
on every rank.

The process group itself is made by the engine (engine/parallel_world.py);
the layers only all-reduce over it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup (None: the default one)

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(first, count) of this rank's equal share of n `what`s."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the {n} {what}; "
                             "choose a size that does")
        k = n // self.size
        return self.rank * k, k

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps: its share, or with
        fewer KV heads than ranks the one its query heads read (replicated)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {self.size} is above the {num_kv_heads} KV heads "
                             "and not a multiple of them: KV heads cannot be replicated evenly")
        first_q, _ = self.split(num_heads, "attention heads")
        return first_q // (num_heads // num_kv_heads), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x itself when there is one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()
