"""The accuracy table of docs/accuracy.md: every configuration, one command.

    qoqserve eval accuracy --out docs/accuracy.md

Each row quantizes the model in memory and measures perplexity through the
fake-quant simulation (same numerics as the integer kernels; KV4 applied to
every position), on the same tokens as the FP row.
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import replace

import torch

from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import NO_TRANSFORMS, ROTATIONS, get_preset, with_rotation
from qoqserve.quant.pipeline import build_fp_model, quantize_model

# g128 is not in the default table: the embedded model's hidden size (576) is not a
# multiple of 128 (the preset works for models where it is)
MAIN_ROWS = ["rtn-w8a8", "rtn-kv4", "rtn-w4a16-g64", "rtn-w4a8kv4-chn", "rtn-w4a8kv4-g64", "chn", "g64"]


def ablation_rows():
    """QoQ g64, adding one step at a time to round-to-nearest W4A8KV4 g64, then
    the variants that are off by default, each measured against the preset."""
    base = get_preset("g64", **NO_TRANSFORMS)
    rows, steps = [], {}
    # the last step (group_search) completes the g64 preset, which is its own row
    for step in ("rotate", "key_transform", "reorder", "smooth_out", "gptq"):
        steps[step] = True
        rows.append(replace(base, name="RTN g64 +" + " +".join(s.replace("_", "-") for s in steps),
                            **steps))
    rows.append(replace(get_preset("g64"), name="QoQ g64 + SmoothAttention (alpha searched per layer)",
                        smooth_attention=True))
    rows.append(replace(get_preset("rtn-kv4"), name="KV4 only + rotate + key-transform", rotate=True,
                        key_transform=True))
    return rows


def run_table(model: str | None, texts: list[str], configs, window: int = 512,
              progress: bool = True) -> list[dict]:

    source = load_model_source(model)
    ids = source.tokenizer.encode(read_texts(texts))
    fp_cfg = get_preset("rtn-kv4", kv_bits=16)
    fp = perplexity(build_fp_model(source, fp_cfg, "cpu").prompt_logprobs, ids, window, window)
    rows = [{"config": "FP32", "ppl": fp.ppl, "delta": 0.0, "seconds": 0.0}]
    print(f"FP32: {fp.ppl:.3f}", flush=True)
    for cfg in configs:
        calib = load_calibration(source.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
        start = time.perf_counter()
        result = quantize_model(source, cfg, calib, progress=progress)
        seconds = time.perf_counter() - start
        ppl = perplexity(result.model.prompt_logprobs, ids, window, window).ppl
        rows.append({"config": cfg.name, "ppl": ppl, "delta": ppl / fp.ppl - 1, "seconds": seconds,
                     "steps": result.steps})
        print(f"{cfg.name}: {ppl:.3f} ({100 * (ppl / fp.ppl - 1):+.1f}%) in {seconds:.0f}s", flush=True)
        del result
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| configuration | perplexity | vs FP32 | quantize time (s) |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        delta = "—" if r["config"] == "FP32" else f"{100 * r['delta']:+.1f}%"
        secs = "—" if r["config"] == "FP32" else f"{r['seconds']:.0f}"
        lines.append(f"| {r['config']} | {r['ppl']:.3f} | {delta} | {secs} |")
    return "\n".join(lines)


def machine_line() -> str:
    return (f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")


def register_args(p) -> None:
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--configs", nargs="*", default=None,
                   help=f"presets to run (default: {' '.join(MAIN_ROWS)} + the g64 ablation)")
    p.add_argument("--model", default=None)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--rotation", choices=ROTATIONS, default=None,
                   help="run the rotating configs with this residual rotation (default: their own; "
                        "'learned' trains it per config, docs/accuracy.md)")


def run_cmd(args) -> int:

    configs = ([get_preset(c) for c in args.configs] if args.configs is not None
               else [get_preset(c) for c in MAIN_ROWS] + ablation_rows())
    rows = run_table(args.model, list(LICENSE_TEXTS), with_rotation(configs, args.rotation), args.window)
    table = to_markdown(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    assert all(math.isfinite(r["ppl"]) for r in rows)
    return 0
