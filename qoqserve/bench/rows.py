"""Benchmark rows written as they are measured: one JSON line and one
markdown table row per result, flushed at once, so a crash or a timeout
later in a run loses nothing already measured."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    bench: str              # "gemm" | "attention" | "kv4_write" | ...
    shape: str
    impl: str
    ms: float | None        # None: the case failed (see error)
    ratio: float | None     # baseline time / this time (> 1: faster than the baseline)
    baseline: str
    backend: str = ""       # e.g. which SDPA backend really ran
    error: str = ""
    extra: dict = field(default_factory=dict)


MD_HEADER = ("| bench | shape | implementation | ms | vs baseline | note |\n"
             "| --- | --- | --- | --- | --- | --- |\n")


def md_row(r: Row) -> str:
    ms = "-" if r.ms is None else f"{r.ms:.4f}"
    ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x {r.baseline}"
    note = r.error.replace("|", "/")[:160] if r.error else r.backend
    return f"| {r.bench} | {r.shape} | {r.impl} | {ms} | {ratio} | {note} |"


def ratio(baseline_ms: float | None, ms: float | None) -> float | None:
    if not baseline_ms or not ms or math.isnan(baseline_ms) or math.isnan(ms):
        return None
    return baseline_ms / ms


class RowWriter:
    """Appends rows to OUT/NAME.jsonl and OUT/NAME.md (header once) and echoes
    them to stdout; out_dir None: stdout only."""

    def __init__(self, out_dir: str | None, name: str = "kernels_gpu", echo: bool = True):
        self.rows: list[Row] = []
        self.echo = echo
        self.jsonl = self.md = None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            self.jsonl = os.path.join(out_dir, name + ".jsonl")
            self.md = os.path.join(out_dir, name + ".md")
            if not os.path.exists(self.md) or os.path.getsize(self.md) == 0:
                with open(self.md, "w") as f:
                    f.write(MD_HEADER)
        if echo:
            print(MD_HEADER, end="", flush=True)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
            with open(self.md, "a") as f:
                f.write(md_row(row) + "\n")
        if self.echo:
            print(md_row(row), flush=True)
        return row


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
