"""Learned vs Hadamard residual rotation on the embedded model (docs/accuracy.md).

    OMP_NUM_THREADS=1 python scripts/learned_rotation_eval.py --steps 50 --out lrot.json
    OMP_NUM_THREADS=1 python scripts/learned_rotation_eval.py --load-r lrot.pt --evals qoq

Trains R once (the training the pipeline runs for rotation="learned"), then
quantizes with it (quantize_model(rotation=R)) and measures perplexity, KL
mean / p99 and same top-1 against FP on the license texts (eval/kl.py, the
`qoqserve eval quality` definitions). --hadamard adds the same rows with the
Hadamard rotation.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from qoqserve.eval.kl import compare
from qoqserve.eval.perplexity import LICENSE_TEXTS, read_texts
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import NO_TRANSFORMS, get_preset
from qoqserve.quant.pipeline import build_fp_model, quantize_model
from qoqserve.quant.transforms.learned_rotation import learn_rotation
from qoqserve.quant.transforms.rotation import fold_norms

EVALS = {"rtn": lambda: replace(get_preset("g64", **{**NO_TRANSFORMS, "rotate": True}), name="RTN g64 +rotate"),
         "qoq": lambda: get_preset("g64")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss", default="kl")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-act-quant", action="store_true")
    p.add_argument("--lr-decay", action="store_true")
    p.add_argument("--kv-quant", action="store_true")
    p.add_argument("--load-r", default=None, help="a saved R (.pt): skip the training")
    p.add_argument("--save-r", default=None)
    p.add_argument("--evals", nargs="*", default=["rtn", "qoq"], choices=list(EVALS))
    p.add_argument("--hadamard", nargs="*", default=[], choices=list(EVALS),
                   help="of these evals also the Hadamard row")
    p.add_argument("--out", default=None, help="JSON of everything measured")
    args = p.parse_args()
    torch.set_num_threads(1)
    source = load_model_source(None)
    train = dict(rotation="learned", rotation_steps=args.steps, rotation_lr=args.lr, rotation_loss=args.loss,
                 rotation_samples=args.samples, rotation_seq_len=args.seq_len, rotation_batch=args.batch,
                 rotation_act_quant=not args.no_act_quant, rotation_lr_decay=args.lr_decay,
                 rotation_kv_quant=args.kv_quant)
    cfg = get_preset("g64", **train)
    calib = load_calibration(source.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
    out = {"train": train, "rows": []}
    if args.load_r:
        r = torch.load(args.load_r)
    else:
        model = build_fp_model(source, cfg, "cpu")
        with torch.no_grad():
            fold_norms(model)
        learned = learn_rotation(model, calib.samples, cfg, progress=True, evaluate=True)
        r = learned.r
        out.update(curve=learned.curve, seconds=learned.seconds, start_loss=learned.start_loss,
                   end_loss=learned.end_loss)
        print(f"trained in {learned.seconds:.0f}s; loss over the {args.samples} training windows "
              f"{learned.start_loss:.4f} (Hadamard) -> {learned.end_loss:.4f}", flush=True)
        del model
        if args.save_r:
            torch.save(r, args.save_r)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    ids = source.tokenizer.encode(read_texts(LICENSE_TEXTS))
    fp = build_fp_model(source, get_preset("rtn-kv4", kv_bits=16), "cpu")
    for name in args.evals:
        for rot in (["hadamard"] if name in args.hadamard else []) + ["learned"]:
            base = EVALS[name]()
            qcfg = replace(base, **train) if rot == "learned" else base
            start = time.perf_counter()
            result = quantize_model(source, qcfg, calib, progress=False,
                                    rotation=r if rot == "learned" else None)
            seconds = time.perf_counter() - start
            kl = compare(fp.prompt_logits, result.model.prompt_logits, ids, 512, 512)
            row = {"config": f"{base.name} ({rot})", "ppl": kl.ppl, "fp_ppl": kl.ref_ppl, "kl_mean": kl.kl_mean,
                   "kl_p99": kl.kl_p99, "same_top": kl.same_top, "quantize_s": seconds}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
            del result
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
