"""A tensor-parallel worker: one rank > 0, holding its shard of the model and
its heads' KV pages, doing what rank 0 broadcasts (docs/parallel.md).

Started by rank 0's executor (torch.multiprocessing spawn, one node), or as
one process of a torchrun world (`qoqserve serve -tp N` under torchrun: ranks
> 0 land here instead of serving).
"""
from __future__ import annotations

import logging
import sys

import torch

from qoqserve.config import EngineConfig
from qoqserve.engine.context_window import context_len
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.engine.parallel_world import ParallelWorld, join_world
from qoqserve.model_loader import load_model_source

log = logging.getLogger(__name__)


def serve_steps(runner: ModelRunner, world: ParallelWorld) -> None:
    """Run rank 0's messages until it says stop: ("step", StepInputs),
    ("logits", token ids, rows, pages), ("pages", page map changes), ("stop",)."""
    while True:
        msg = world.broadcast()
        if msg[0] == "step":
            runner.execute(msg[1])
        elif msg[0] == "pages":
            runner.map_pages(msg[1])
        elif msg[0] == "logits":
            runner.prompt_logits(*msg[1:])
        elif msg[0] == "stop":
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {msg[0]!r}")


def run_worker(config: EngineConfig, rank: int, init_method: str | None = None,
               errors=None) -> None:
    """Join the world as `rank`, load this rank's shard, serve steps. A failure is
    put on `errors` (spawned workers: rank 0 reports it) and ends the process."""
    size = config.parallel.tensor_parallel_size
    world = None
    try:
        if errors is not None:
            errors.put("started")
        if config.device == "cpu":  # the ranks of one node share its cores
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        world = join_world(rank, size, config.device, config.parallel.distributed_timeout_s, init_method)
        source = load_model_source(config.model, config.tokenizer)
        runner = ModelRunner(config, source.arch, source.iter_tensors(lazy=True), context_len(config, source.arch),
                             source.quant_config, world=world)
        serve_steps(runner, world)
    except BaseException as e:
        log.exception("tensor-parallel rank %d failed", rank)
        if errors is not None:
            errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        if world is not None:
            world.close()
