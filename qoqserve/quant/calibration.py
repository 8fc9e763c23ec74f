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
    samples: list[list[int]]     # token ids, one list per window (lengths may differ)
    sha256: str                  # of the source text, recorded in the checkpoint
    source: str

    def describe(self) -> str:
        """e.g. "9 x 2048 + 36 x 512 tokens"."""
        counts: dict[int, int] = {}
        for s in self.samples:
            counts[len(s)] = counts.get(len(s), 0) + 1
        return " + ".join(f"{n} x {length}" for length, n in sorted(counts.items(), reverse=True)) + " tokens"


def load_calibration(tokenizer, path: str | None, num_samples: int, seq_len: int,
                     long_samples: int = 0, long_seq_len: int = 2048) -> CalibrationSet:
    """Cut the text into num_samples windows of seq_len tokens, evenly spread.
    With long_samples, the text is first cut into that many equal spans, each
    opening with one window of long_seq_len tokens followed by as many windows
    of seq_len as the span holds (num_samples of them at most in all): every
    part of the text is seen at both lengths, and positions past seq_len are
    calibrated too (what long-context retrieval runs on: docs/accuracy.md)."""
    path = path or DEFAULT_CALIB_FILE
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if long_samples:
        span = len(ids) // long_samples
        if span < long_seq_len:
            raise ValueError(f"{path}: {len(ids)} tokens hold fewer than {long_samples} calibration "
                             f"windows of {long_seq_len}")
        samples, short = [], 0
        for j in range(long_samples):
            start = j * span
            samples.append(ids[start:start + long_seq_len])
            at = start + long_seq_len
            while at + seq_len <= start + span and short < num_samples:
                samples.append(ids[at:at + seq_len])
                at, short = at + seq_len, short + 1
        return CalibrationSet(samples, digest, os.path.abspath(path))
    if len(ids) < seq_len:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than one calibration sample of {seq_len}")
    available = len(ids) // seq_len
    n = min(num_samples, available)
    step = available / n
    samples = [ids[int(i * step) * seq_len:(int(i * step) + 1) * seq_len] for i in range(n)]
    return CalibrationSet(samples, digest, os.path.abspath(path))


def calibration_for(tokenizer, path: str | None, cfg) -> CalibrationSet:
    """The windows a QuantConfig asks for (its calib_* fields)."""
    return load_calibration(tokenizer, path, cfg.calib_samples, cfg.calib_seq_len,
                            cfg.calib_long_samples, cfg.calib_long_seq_len)
