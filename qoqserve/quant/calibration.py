"""Calibration text: what the quantizer measures activations on.

The default set ships with the package (qoqserve/data/calibration_en.txt). It
was written by the embedded SmolLM2-135M-Instruct itself from the prompts in
scripts/make_calibration_text.py, so the project may redistribute it, and it
never overlaps the evaluation texts (the license files in
/usr/share/common-licenses): a test checks that no 12-token run is shared.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

DEFAULT_CALIB_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                                  "calibration_en.txt")

@dataclass
class CalibrationSet:
    samples: list[list[int]]     # token ids, each of seq_len tokens
    sha256: str                  # of the source text, recorded in the checkpoint
    source: str


def load_calibration(tokenizer, path: str | None, num_samples: int, seq_len: int) -> CalibrationSet:
    """Cut the text into num_samples windows of seq_len tokens, evenly spread."""
    path = path or DEFAULT_CALIB_FILE
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < seq_len:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than one calibration sample of {seq_len}")
    available = len(ids) // seq_len
    n = min(num_samples, available)
    step = available / n
    samples = [ids[int(i * step) * seq_len:(int(i * step) + 1) * seq_len] for i in range(n)]
    return CalibrationSet(samples, hashlib.sha256(text.encode()).hexdigest(), os.path.abspath(path))
