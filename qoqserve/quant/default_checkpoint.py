"""The embedded default model as a QoQ checkpoint, quantized on first use.

`qoqserve serve --model qoq` (or LLM("qoq")) quantizes SmolLM2-135M-Instruct
with the g64 preset once and reuses the result from the cache directory
($QOQSERVE_CACHE, else ~/.cache/qoqserve).
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from qoqserve.layers.quantization.qoq import FORMAT_VERSION
from qoqserve.model_loader import load_model_source
from qoqserve.paths import cache_dir
from qoqserve.quant.calibration import calibration_for
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import QuantConfig, get_preset
from qoqserve.quant.pipeline import QUANTIZER_REVISION, quantize_model

ALIASES = {"qoq": "g64", "qoq-g64": "g64", "qoq-g128": "g128", "qoq-chn": "chn", "qoq-tuned": "g64-tuned"}


def _is_current(out: str, preset: str) -> bool:
    """A cached checkpoint is reused only if today's code would write the same one:
    same format version, quantizer revision and preset settings (a stale cache
    re-quantizes)."""
    try:
        with open(os.path.join(out, "quant_config.json")) as f:
            quant = json.load(f)
    except (OSError, ValueError):
        return False
    stored = quant.get("config")
    if (quant.get("version") != FORMAT_VERSION or quant.get("quantizer_revision") != QUANTIZER_REVISION
            or not isinstance(stored, dict)):
        return False
    # as JSON holds it (tuples as lists); an option newer than the cache, at
    # the value that reproduces what the cache was made without, is no change
    want = json.loads(json.dumps(get_preset(preset).to_dict()))
    default = json.loads(json.dumps(QuantConfig().to_dict()))
    stored = {**{k: v for k, v in want.items() if k not in stored and v == default[k]}, **stored}
    return stored == want


def default_qoq_checkpoint(preset: str = "g64", progress: bool = True) -> str:
    out = os.path.join(cache_dir(), f"SmolLM2-135M-Instruct-qoq-{preset}")
    if _is_current(out, preset):
        return out
    why = "made by another qoqserve version" if os.path.exists(out) else "first use only"
    print(f"qoqserve: quantizing the embedded model with QoQ {preset} ({why}) -> {out}",
          file=sys.stderr)
    source = load_model_source(None)
    cfg = get_preset(preset)
    calib = calibration_for(source.tokenizer, None, cfg)
    result = quantize_model(source, cfg, calib, progress=progress)
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(result, source, calib, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # never leave a half-written checkpoint under the final name
    return out


def resolve_model(name: str | None) -> str | None:
    """Map the qoq aliases to their cached checkpoint; other names pass through.
    Called above the engine (LLM, the CLI, the benchmarks): the engine takes paths."""
    if name is not None and name.lower() in ALIASES:
        return default_qoq_checkpoint(ALIASES[name.lower()])
    return name
