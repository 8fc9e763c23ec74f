#!/usr/bin/env python
"""Does the calibration text's domain or size move QoQ's accuracy? (issue #19)

    python scripts/calibration_domains.py --calib shipped \
        --calib vim-manual=/usr/share/vim/vim90/doc/usr_*.txt [--windows 74] [--preset g64]

Each --calib NAME=GLOB (the files concatenated; "shipped" alone is the
text in qoqserve/data) is cut into --windows windows of 512 tokens, evenly
spread (0: all of it), checked for 12-token runs shared with the evaluation
text (reported; a text that shares any is not run), and quantizes the
preset in memory; each result is measured against the FP model on the
license texts: perplexity, KL mean / p99, same top (eval/kl.py). A text
used here is read, not shipped: only the shipped calibration text is
redistributed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time

import torch

from qoqserve.eval import kl
from qoqserve.eval.perplexity import LICENSE_TEXTS, read_texts
from qoqserve.eval.quality import Memo
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import DEFAULT_CALIB_FILE, load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model, quantize_model

NGRAM = 12


def ngrams(ids: list[int]) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + NGRAM]) for i in range(len(ids) - NGRAM + 1)}


def text_file(spec: str, tmp: str) -> tuple[str, str]:
    """NAME=GLOB -> (name, one file holding the matched files' text)."""
    if spec == "shipped":
        return spec, DEFAULT_CALIB_FILE
    name, _, pattern = spec.partition("=")
    files = sorted(p for part in pattern.split(",") for p in glob.glob(part))
    if not files:
        raise SystemExit(f"--calib {spec}: no file matches")
    path = os.path.join(tmp, name + ".txt")
    with open(path, "w", encoding="utf-8") as out:
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as src:
                out.write(src.read() + "\n")
    return name, path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calib", action="append", required=True, metavar="NAME=GLOB")
    ap.add_argument("--windows", type=int, default=0, help="windows of 512 tokens per text (0: all)")
    ap.add_argument("--preset", default="g64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    source = load_model_source(None)
    tok = source.tokenizer
    ids = tok.encode(read_texts(LICENSE_TEXTS))
    eval_grams = ngrams(tok.encode(read_texts(LICENSE_TEXTS), add_special_tokens=False))
    fp_logits = Memo(build_fp_model(source, get_preset("rtn-kv4", kv_bits=16), "cpu").prompt_logits)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.calib:
            name, path = text_file(spec, tmp)
            calib = load_calibration(tok, path, args.windows or 10**9, 512)
            shared = ngrams([t for s in calib.samples for t in s]) & eval_grams
            row = {"calib": name, "windows": len(calib.samples), "shared_12grams": len(shared)}
            if shared:
                print(f"{name}: shares {len(shared)} 12-token runs with the evaluation text: not run")
                rows.append(row)
                continue
            cfg = get_preset(args.preset, calib_samples=len(calib.samples))
            start, cpu = time.perf_counter(), time.process_time()
            result = quantize_model(source, cfg, calib, progress=False)
            row.update(quantize_seconds=round(time.perf_counter() - start, 1),
                       quantize_cpu_seconds=round(time.process_time() - cpu, 1))
            d = kl.compare(fp_logits, result.model.prompt_logits, ids, 512, 512)
            row.update(ppl=d.ppl, fp_ppl=d.ref_ppl, ppl_delta=d.ppl / d.ref_ppl - 1, kl_mean=d.kl_mean,
                       kl_p99=d.kl_p99, same_top=d.same_top)
            print(f"{name}: {row['windows']} windows, ppl {d.ppl:.3f} ({100 * row['ppl_delta']:+.1f}%), "
                  f"KL {d.kl_mean:.4f} p99 {d.kl_p99:.3f}, same top {100 * d.same_top:.1f}%, "
                  f"quantized in {row['quantize_seconds']:.0f} s ({row['quantize_cpu_seconds']:.0f} CPU-s, "
                  f"{torch.get_num_threads()} threads)", flush=True)
            rows.append(row)
            del result
    print("| calibration text | windows x 512 | PPL | vs FP | KL mean | KL p99 | same top |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "ppl" in r:
            print(f"| {r['calib']} | {r['windows']} | {r['ppl']:.3f} | {100 * r['ppl_delta']:+.1f}% | "
                  f"{r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {100 * r['same_top']:.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
