"""Command-line flags generated from config dataclasses: each field's name is
its flag (`--max-num-seqs`), its default and its help (`config.opt`) the
flag's, so the CLI, the Python API and the docs share one set of names.
A field's metadata may add `choices`, `short` flags, `aliases` (older
spellings of --no-FLAG), `type` (a parser for the text), `nargs`, `env` (an
environment variable giving the default) or `cli: False` (no flag)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing


def _scalar_type(hint):
    """int for `int | None`, str for `str | torch.dtype`, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(
        hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    for t in (bool, int, float, str):
        if t in args:
            return t
    return str


def config_fields(cls, skip: tuple[str, ...] = ()):
    """(field, its flag's value type) of each of cls's fields that has a flag."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        yield f, f.metadata.get("type") or _scalar_type(hints[f.name])


def add_config_args(g, cls, skip: tuple[str, ...] = ()) -> None:
    """A flag for each of cls's fields (but `skip`) in g (a parser or a group)."""
    for f, kind in config_fields(cls, skip):
        flag = f"--{f.name.replace('_', '-')}"
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if "env" in f.metadata:
            default = os.environ.get(f.metadata["env"], default)
        kw = {"default": default, "help": f.metadata["help"], "dest": f.name}
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            for alias in f.metadata.get("aliases", ()):
                g.add_argument(alias, action="store_false", dest=f.name, help=argparse.SUPPRESS)
        else:
            if "nargs" in f.metadata:
                kw["nargs"] = f.metadata["nargs"]
            g.add_argument(flag, *f.metadata.get("short", ()), type=kind, choices=f.metadata.get("choices"), **kw)


def picked(cls, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    """cls's fields as the parsed flags set them."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and hasattr(args, f.name)}
