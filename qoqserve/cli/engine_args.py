"""The engine's command-line flags, generated from the config dataclasses
(qoqserve/config.py): one set of names, defaults and help texts for the CLI,
the Python API and the docs."""
from __future__ import annotations

import argparse

from qoqserve.cli.config_args import add_config_args, picked
from qoqserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig

_NESTED = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}


def add_engine_args(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    g = p.add_argument_group("engine")
    add_config_args(g, EngineConfig, skip=(*_NESTED, *(() if model_flag else ("model",))))
    for cls in _NESTED.values():
        add_config_args(g, cls)


def engine_config(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """EngineConfig from parsed flags; `model` already resolved to a path."""
    top = picked(EngineConfig, args, skip=tuple(_NESTED))
    top["model"] = model
    return EngineConfig(**top, **{name: cls(**picked(cls, args)) for name, cls in _NESTED.items()})


def make_engine(args: argparse.Namespace, model: str | None):
    """The LLMEngine the flags describe; `qoq` aliases resolve here, above the
    engine (quantizing the embedded model on first use)."""
    # lazy: CLI start-up (`qoqserve --help` must not load the engine stack)
    from qoqserve.engine.llm_engine import LLMEngine
    from qoqserve.engine.parallel_world import launched_by_torchrun, torchrun_rank
    from qoqserve.engine.worker import run_worker
    from qoqserve.quant.default_checkpoint import resolve_model

    config = engine_config(args, resolve_model(model))
    if config.parallel.tensor_parallel_size > 1 and launched_by_torchrun() and torchrun_rank() != 0:
        # a torchrun rank > 0: it runs rank 0's steps, rank 0 does the command
        run_worker(config, torchrun_rank())
        raise SystemExit(0)
    return LLMEngine(config)
