"""The engine's command-line flags, generated from the config dataclasses
(qoqserve/config.py): one set of names, defaults and help texts for the CLI,
the Python API and the docs."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from qoqserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig

_GROUPS = (EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig)
_NESTED = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}


def _scalar_type(hint):
    """int for `int | None`, str for `str | torch.dtype`, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(
        hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    for t in (bool, int, float, str):
        if t in args:
            return t
    return str


def _fields():
    for cls in _GROUPS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _NESTED or not f.metadata.get("cli", True):
                continue
            yield f, _scalar_type(hints[f.name])


def add_engine_args(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    g = p.add_argument_group("engine")
    for f, kind in _fields():
        if f.name == "model" and not model_flag:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        kw = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            for alias in f.metadata.get("aliases", ()):  # older spellings of --no-FLAG
                g.add_argument(alias, action="store_false", dest=f.name, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, *f.metadata.get("short", ()), type=kind,
                           choices=f.metadata.get("choices"), **kw)


def engine_config(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """EngineConfig from parsed flags; `model` already resolved to a path."""
    def pick(cls):
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                if f.name not in _NESTED and hasattr(args, f.name)}
    top = pick(EngineConfig)
    top["model"] = model
    return EngineConfig(**top, cache=CacheConfig(**pick(CacheConfig)),
                        scheduler=SchedulerConfig(**pick(SchedulerConfig)),
                        parallel=ParallelConfig(**pick(ParallelConfig)))


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
