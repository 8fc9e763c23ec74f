#!/usr/bin/env python
"""Where a cold default quantization of the embedded model spends its time.

    python scripts/quantize_time.py [--preset g64] [--layers N] [--no-eval] [--json out.json]

Times the whole `qoqserve quantize` path (load the GGUF, tokenize the
calibration text, quantize, write the checkpoint) and, by wrapping the
pipeline's steps, each step's share; then the perplexity of the result on
the license texts (the simulation `qoqserve eval accuracy` measures).
--layers N quantizes only the first N decoder layers (a quick profile; no
checkpoint, no perplexity). On a shared machine the wall time depends on the
load; the process's CPU time (with OMP_NUM_THREADS=1) much less so. Numbers
for docs/accuracy.md.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict

import torch

from qoqserve.quant import gptq, layer_passes, pipeline

SECONDS: dict[str, float] = defaultdict(float)
CPU: dict[str, float] = defaultdict(float)  # process CPU seconds (all threads)
ORDER = ["load GGUF + tokenize calibration", "load + build the fp32 model", "rotate",
         "measuring pass (FP layer, hooks)", "  of which Hessians", "transforms (key, reorder, smooth)",
         "  of which smooth alpha search", "GPTQ", "  of which group search",
         "propagating pass (quantized layer)", "scale tuning",
         "write checkpoint"]


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CPU[label] += time.process_time() - cpu
    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(pipeline, "build_fp_model", "load + build the fp32 model")
    timed(pipeline, "rotate_model", "rotate")
    timed(gptq.HessianAccumulator, "add", "  of which Hessians")
    timed(pipeline, "_transform_layer", "transforms (key, reorder, smooth)")
    timed(pipeline, "search_alpha", "  of which smooth alpha search")
    timed(pipeline, "gptq_quantize", "GPTQ")
    timed(pipeline, "search_group_params", "  of which group search")
    timed(pipeline, "tune_scales", "scale tuning")
    run_layer = layer_passes.run_layer
    calls = defaultdict(int)

    def run_layer_timed(layer, *args, **kwargs):
        # the first pass over a layer measures it, the second feeds the next layer
        label = "measuring pass (FP layer, hooks)" if calls[id(layer)] == 0 else "propagating pass (quantized layer)"
        calls[id(layer)] += 1
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return run_layer(layer, *args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CPU[label] += time.process_time() - cpu
    layer_passes.run_layer = run_layer_timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="g64")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="keep the checkpoint here (default: a temporary dir)")
    args = ap.parse_args()
    instrument()
    if args.layers:
        real_tqdm = pipeline.tqdm
        pipeline.tqdm = lambda it, **kw: real_tqdm(list(it)[:args.layers], **kw)

    from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
    from qoqserve.model_loader import load_model_source
    from qoqserve.quant.calibration import load_calibration
    from qoqserve.quant.checkpoint import save_checkpoint
    from qoqserve.quant.config import get_preset

    start, cpu_start = time.perf_counter(), time.process_time()
    source = load_model_source(None)
    cfg = get_preset(args.preset)
    calib = load_calibration(source.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
    SECONDS["load GGUF + tokenize calibration"] = time.perf_counter() - start
    CPU["load GGUF + tokenize calibration"] = time.process_time() - cpu_start
    result = pipeline.quantize_model(source, cfg, calib, progress=False)
    if not args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            t, c = time.perf_counter(), time.process_time()
            save_checkpoint(result, source, calib, args.out or os.path.join(tmp, "ckpt"))
            SECONDS["write checkpoint"] = time.perf_counter() - t
            CPU["write checkpoint"] = time.process_time() - c
    total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    report = {"preset": cfg.name, "threads": torch.get_num_threads(), "calibration": len(calib.samples),
              "load_average": os.getloadavg(), "cold_seconds": round(total, 1), "cpu_seconds": round(cpu, 1),
              "quantize_model_seconds": round(result.seconds, 1),
              "steps": {k.strip(): round(SECONDS[k], 2) for k in ORDER if k in SECONDS},
              "steps_cpu": {k.strip(): round(CPU[k], 2) for k in ORDER if k in CPU}}
    print(f"cold quantization ({cfg.name}, {len(calib.samples)} windows, {torch.get_num_threads()} threads): "
          f"{total:.1f} s (quantize_model {result.seconds:.1f} s), {cpu:.1f} CPU-seconds")
    for k in ORDER:
        if k in SECONDS:
            print(f"  {k:<40} {SECONDS[k]:7.1f} s wall {CPU[k]:7.1f} s CPU")
    if not args.layers and not args.no_eval:
        ids = source.tokenizer.encode(read_texts(LICENSE_TEXTS))
        report["ppl"] = perplexity(result.model.prompt_logprobs, ids, 512, 512).ppl
        print(f"perplexity (simulation, license texts): {report['ppl']:.4f}")
    report["load_average_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
