"""Rank 0's side of tensor parallelism: starts (or joins) the other ranks and
broadcasts each step's inputs to them, as vLLM's executor does.

Rank 0 owns the scheduler, the block manager and the sampler; it turns a
scheduled batch into plain lists (StepInputs), broadcasts them once, and every
rank then runs the same forward over its shard (the all-reduces line the
ranks up); only rank 0 computes logits and samples.

On one node the workers are spawned here (torch.multiprocessing, "spawn":
CUDA cannot be forked); under torchrun every rank is a process torchrun
started, rank 0 the one that serves. Any failure of a worker or a
collective becomes one WorkerFailedError, and from then on every call fails
at once: the ranks may be mid-step, so nothing can be trusted to continue.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from qoqserve.config import EngineConfig
from qoqserve.engine.parallel_world import START_TIMEOUT_S, join_world, launched_by_torchrun
from qoqserve.engine.worker import run_worker
from qoqserve.errors import WorkerFailedError

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_config(config: EngineConfig, rank: int) -> EngineConfig:
    if config.device.startswith("cuda"):
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig):
        size = config.parallel.tensor_parallel_size
        self.procs: list = []
        self.errors = None
        self.failed: str | None = None
        self._early_errors: list[str] = []
        timeout = config.parallel.distributed_timeout_s
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine: one per process "
                               "(shut the other down first)")
        if launched_by_torchrun():
            self.world = join_world(0, size, config.device, timeout)
        else:
            ctx = mp.get_context("spawn")
            init = f"tcp://127.0.0.1:{_free_port()}"
            self.errors = ctx.SimpleQueue()
            for rank in range(1, size):
                p = ctx.Process(target=run_worker, name=f"qoqserve-tp{rank}", daemon=True,
                                args=(_worker_config(config, rank), rank, init, self.errors))
                p.start()
                self.procs.append(p)
            try:
                self._wait_started(START_TIMEOUT_S)
                self.world = join_world(0, size, config.device, timeout, init)
            except Exception as e:
                self._kill()
                raise self.failure(e) from e
        atexit.register(self.shutdown)

    def _wait_started(self, timeout: float) -> None:
        """Until every worker runs run_worker; a worker that dies first (e.g. a
        script without an `if __name__ == "__main__":` guard, which spawn
        re-imports) fails here at once instead of at the rendezvous timeout."""
        started, deadline = 0, time.monotonic() + timeout
        while started < len(self.procs):
            dead = [p for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError("a worker exited while starting (a script that starts a tensor-"
                                   "parallel engine needs an `if __name__ == \"__main__\":` guard)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not start within {timeout:.0f} s")
            if self.errors.empty():
                time.sleep(0.05)
                continue
            msg = self.errors.get()
            if msg == "started":
                started += 1
            else:
                self._early_errors.append(msg)
                raise RuntimeError(msg)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, msg) -> None:
        """Broadcast msg to every worker (WorkerFailedError when one is gone)."""
        if self.failed is None:
            dead = [p for p in self.procs if not p.is_alive()]
            if not dead:
                try:
                    self.world.broadcast(msg)
                    return
                except Exception as e:
                    raise self.failure(e) from e
        raise self.failure(None)

    def failure(self, cause: BaseException | None) -> WorkerFailedError:
        """The error that ends the engine, naming what is known of the cause;
        the surviving workers are stopped (they may sit in a collective)."""
        if self.failed is None:
            for p in self.procs:  # a rank killed a moment ago may not be reaped yet: say which
                p.join(1.0)
            why = [f"rank {i + 1} (pid {p.pid}) exited with code {p.exitcode}"
                   for i, p in enumerate(self.procs) if not p.is_alive()]
            why += self._early_errors + self._reported()
            if cause is not None:
                why.append(f"{type(cause).__name__}: {cause}")
            self.failed = "tensor-parallel engine failed: " + ("; ".join(why) or "unknown cause")
            log.error("%s", self.failed)
            self._kill()
        return WorkerFailedError(self.failed)

    def _reported(self) -> list[str]:
        out = []
        while self.errors is not None:
            try:
                if self.errors.empty():
                    break
                out.append(self.errors.get())
            except (OSError, EOFError, queue.Empty):
                break
        return out

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        atexit.unregister(self.shutdown)
        if self.failed is None and self.procs is not None:
            try:
                self.send(("stop",))
            except WorkerFailedError:
                pass
            for p in self.procs:
                p.join(10)
        self._kill()
        self.failed = self.failed or "the engine was shut down"
        if hasattr(self, "world"):
            self.world.close()
