#!/usr/bin/env python
"""Which linears of the QoQ model cost the most: quantize once, then put
one group of linears at a time back to W8A8 (per-channel INT8 weights from
the same rotated / smoothed weights, per-token INT8 activations) and measure
the next-token KL divergence to FP, the same-top-1 rate and the perplexity
on the first windows of the license texts. docs/accuracy.md ("Where the W4
loss is") lists the runs made with it.

    OMP_NUM_THREADS=1 python scripts/sensitivity.py --windows 4 --out /tmp/sens.jsonl
    python scripts/sensitivity.py --set true_sequential=True --cache /tmp/ts.pt --windows 0 --groups base
    python scripts/sensitivity.py --groups base --keep 'layers.0.*,*.mlp.down_proj'

Groups: each linear type over all layers ("type:mlp.down_proj"), each
layer's four linears ("layer:7"), and --pairs: each (layer, linear) of the
--top most costly layers. The other linears stay as quantized, so a group's
gain is what keeping it at W8A8 would recover given everything else W4 (the
upstream GPTQ was calibrated on the W4 version: an estimate, not a re-run).
"""
import argparse
import ast
import copy
import fnmatch
import json
import math
import os
import time

import torch

from qoqserve.eval.kl import token_kl
from qoqserve.eval.perplexity import LICENSE_TEXTS, read_texts, scored_windows
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.model_loader import load_model_source
from qoqserve.quant import sim
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import LINEARS, build_fp_model, quantize_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="g64")
    p.add_argument("--set", nargs="*", default=[], help="QuantConfig overrides, e.g. true_sequential=True")
    p.add_argument("--windows", type=int, default=4,
                   help="512-token windows of the license texts scored (0: all)")
    p.add_argument("--groups", default="base,types,layers,all",
                   help="comma-separated, in order: base, types, layers, all (every linear W8A8)")
    p.add_argument("--keep", nargs="*", default=[], metavar="PATTERNS",
                   help="extra groups: each a comma-separated list of fnmatch patterns over "
                        "layers.{i}.{linear} (a mixed recipe, estimated on this model)")
    p.add_argument("--cache", default="/tmp/qoq_sensitivity_g64.pt",
                   help="quantized model + pre-quantization weights, reused when present")
    p.add_argument("--pairs", action="store_true", help="also each linear of the --top costliest layers")
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--out", default=None, help="append one JSON line per group here")
    return p.parse_args()


def quantized(source, cfg, cache: str):
    if os.path.exists(cache):
        saved = torch.load(cache, weights_only=False)
        return saved["model"], saved["float"], saved["seconds"]
    calib = load_calibration(source.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
    weights: dict = {}
    result = quantize_model(source, cfg, calib, float_weights=weights)
    torch.save({"model": result.model, "float": weights, "seconds": result.seconds}, cache)
    return result.model, weights, result.seconds


class Scorer:
    """KL / same-top / perplexity against FP logits computed once."""

    def __init__(self, fp_model, ids: list[int], windows: int):
        self.chunks = []
        for begin, end, first in list(scored_windows(len(ids), 512, 512))[:windows or None]:
            chunk = ids[begin:end]
            rows = list(range(first - begin - 1, end - begin - 1))
            targets = torch.tensor(chunk[first - begin:])[:, None]
            ref = torch.log_softmax(fp_model.prompt_logits(chunk, rows), -1)
            self.chunks.append((chunk, rows, targets, ref))

        self.states = None  # per window, (h, delta) at each layer's input in the unchanged model

    @torch.inference_mode()
    def _logits(self, model, w: int, chunk: list[int], rows: list[int], start: int) -> torch.Tensor:
        """prompt_logits, from layer `start` on when the layers before it are unchanged."""
        n = len(chunk)
        meta = AttentionMetadata(True, None, None, None, [0, n], [0])
        positions = torch.arange(n)
        if start:
            h, delta = self.states[w][start]
        else:
            h, delta = model.token_ops.embed(torch.tensor(chunk), model.embed_tokens), None
        record = self.states is not None and len(self.states[w]) == 0
        for i in range(start, len(model.layers)):
            if record:
                self.states[w].append((h, delta))
            h, delta = model.layers[i](positions, h, meta, None, delta)
        hidden = model.norm(h, delta)[0]
        return model.compute_logits(hidden[torch.tensor(rows)]).float()

    def remember(self) -> None:
        """The next call's model is the base: keep its per-layer states."""
        self.states = [[] for _ in self.chunks]

    def __call__(self, model, start: int = 0) -> dict:
        kls, same, nll, ref_nll, n = [], 0, 0.0, 0.0, 0
        for w, (chunk, rows, targets, ref) in enumerate(self.chunks):
            logits = self._logits(model, w, chunk, rows, start)
            kls.append(token_kl(ref, logits))
            same += int((ref.argmax(-1) == logits.argmax(-1)).sum())
            nll -= float(torch.log_softmax(logits, -1).gather(1, targets).double().sum())
            ref_nll -= float(ref.gather(1, targets).double().sum())
            n += len(rows)
        kl = torch.cat(kls).double()
        return {"kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)), "same_top": same / n,
                "ppl": math.exp(nll / n), "fp_ppl": math.exp(ref_nll / n), "tokens": n}


def keep_w8a8(model, weights: dict, names: list[str]) -> list:
    """Swap the named linears to fake W8A8; returns what restore() needs."""
    saved = []
    for key in names:
        _, i, path = key.split(".", 2)
        parent_path, attr = path.rsplit(".", 1)
        parent = model.layers[int(i)].get_submodule(parent_path)
        saved.append((parent, attr, getattr(parent, attr)))
        linear = copy.deepcopy(getattr(parent, attr))
        sim.convert_to_w8a8(linear, weights[key])
        setattr(parent, attr, linear)
    return saved


def linear_bytes(model, keys: set[str], group: int) -> dict:
    """Bytes of all linears, with `keys` at W8A8: in the checkpoint (fp16 weight,
    docs/format.md) and resident at run time (INT8 codes + fp32 scale)."""
    ckpt = resident = 0
    for i, layer in enumerate(model.layers):
        for n in LINEARS:
            lin = layer.get_submodule(n)
            out, k = lin.out_features, lin.in_features
            if f"layers.{i}.{n}" in keys:
                ckpt, resident = ckpt + 2 * out * k, resident + out * k + 4 * out
            else:  # packed codes, s2 + zero per group, fp16 s1
                w4 = out * k // 2 + 2 * out * (k // group) + 2 * out
                ckpt, resident = ckpt + w4, resident + w4
    return {"linear_bytes_checkpoint": ckpt, "linear_bytes_resident": resident}


def restore(saved: list) -> None:
    for parent, attr, module in saved:
        setattr(parent, attr, module)


def main() -> None:
    args = parse_args()
    overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = get_preset(args.preset, **overrides)
    source = load_model_source(None)
    ids = source.tokenizer.encode(read_texts(LICENSE_TEXTS))
    t0 = time.perf_counter()
    scorer = Scorer(build_fp_model(source, get_preset("rtn-kv4", kv_bits=16), "cpu"), ids, args.windows)
    model, weights, seconds = quantized(source, cfg, args.cache)
    num_layers = len(model.layers)
    every = [f"layers.{i}.{n}" for i in range(num_layers) for n in LINEARS]
    kinds = {"base": [("as quantized", [])],
             "types": [(f"type:{n}", [f"layers.{i}.{n}" for i in range(num_layers)]) for n in LINEARS],
             "layers": [(f"layer:{i}", [f"layers.{i}.{n}" for n in LINEARS]) for i in range(num_layers)],
             "all": [("all W8A8", every)]}
    groups = [g for kind in args.groups.split(",") for g in kinds[kind]]
    for keep in args.keep:
        patterns = keep.split(",")
        groups.append((f"keep:{keep}", [k for k in every if any(fnmatch.fnmatchcase(k, p) for p in patterns)]))
    results = []

    def run(name, names):
        saved = keep_w8a8(model, weights, names)
        # the layers before the first swapped one run as in the base model
        start = min((int(k.split(".")[1]) for k in names), default=0) if scorer.states else 0
        if not names:
            scorer.remember()
        w8a8 = set(names) | set(cfg.w8a8_names(num_layers))
        r = {"group": name, "linears": len(names), **scorer(model, start), "config": cfg.name, "set": args.set,
             "quantize_s": round(seconds), **linear_bytes(model, w8a8, cfg.group_size)}
        restore(saved)
        results.append(r)
        print(f"{name:28s} KL {r['kl_mean']:.4f}  top1 {100 * r['same_top']:.1f}%  "
              f"ppl {r['ppl']:.3f} ({100 * (r['ppl'] / r['fp_ppl'] - 1):+.1f}%)  "
              f"linears {r['linear_bytes_checkpoint'] / 2**20:.1f} MiB", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    print(f"quantized in {seconds:.0f}s", flush=True)
    for name, names in groups:
        run(name, names)
    if args.pairs:
        by_layer = sorted((r for r in results if r["group"].startswith("layer:")), key=lambda r: r["kl_mean"])
        for r in by_layer[:args.top]:
            i = int(r["group"].split(":")[1])
            for n in LINEARS:
                run(f"layers.{i}.{n}", [f"layers.{i}.{n}"])
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
