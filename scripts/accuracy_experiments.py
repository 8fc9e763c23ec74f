#!/usr/bin/env python
"""One quantization experiment on the embedded model: a preset with overrides,
optionally with an attention-side variant patched in, and its perplexity on
the license texts. docs/accuracy.md ("How the KV4 loss was found") lists the
runs made with it.

    python scripts/accuracy_experiments.py rtn-kv4 --set rotate=True smooth_attention=True --kv k
    python scripts/accuracy_experiments.py g64 --tokens 0          # whole evaluation text

Variants (all applied to the K/V that attention sees, fake-quantized as the
cache would hold them; exploration only, the runtime has none of them):
  --kv k|v          quantize only K or only V
  --sink N          keep the first N tokens of each window unquantized
  --kmean           subtract each window's mean key (post-RoPE) before quantizing
  --qk-had          multiply q and k by a normalized Hadamard matrix per head
  --kv-clip R       K/V ranges clipped to R of (max - min) about their middle;
                    "search": per row, the least squared error of 1, .95, .9, .85, .8
  --down-rotation   an online signed Hadamard on every down_proj input (QuaRot's
                    R4), its transpose folded into down_proj; "plain": down_proj's
                    reorder and smoothing off, "folded": both applied after the
                    Hadamard (online too)
  --kl              also KL to the FP model and same-top (eval/kl.py)
The KeyTransform that came out of these (`key_transform=True`) needs no patch.
"""
import argparse
import ast
import dataclasses
import json
import time

import torch

from qoqserve.eval import kl
from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.kernels import kv_ref
from qoqserve.layers import attention
from qoqserve.model_loader import load_model_source
from qoqserve.quant import pipeline
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.hadamard import hadamard_matrix
from qoqserve.quant.transforms.smooth import smooth_scales


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset")
    p.add_argument("--set", nargs="*", default=[], help="QuantConfig overrides, e.g. rotate=True")
    p.add_argument("--kv", choices=["kv", "k", "v"], default="kv")
    p.add_argument("--sink", type=int, default=0)
    p.add_argument("--kmean", action="store_true")
    p.add_argument("--qk-had", action="store_true")
    p.add_argument("--kv-clip", default=None)
    p.add_argument("--down-rotation", choices=["plain", "folded"], default=None)
    p.add_argument("--kl", action="store_true")
    p.add_argument("--tokens", type=int, default=4096, help="evaluation tokens (0 = all)")
    return p.parse_args()


def patch_attention(args) -> None:
    original = attention.PagedAttention.forward

    def forward(self, q, k, v, meta, cache):
        if args.kmean and meta.is_prefill:
            k = k.clone()
            st = meta.query_starts
            for i in range(len(st) - 1):
                k[st[i]:st[i + 1]] -= k[st[i]:st[i + 1]].mean(0, keepdim=True)
        if args.qk_had:
            h = (hadamard_matrix(q.shape[-1]) / q.shape[-1] ** 0.5).to(q.dtype)
            q, k = q @ h, k @ h
        if not (meta.is_prefill and self.backend.quantized_prefill):
            return original(self, q, k, v, meta, cache)
        kq = k if args.kv == "v" else self.layout.fake_quant(k)
        vq = v if args.kv == "k" else self.layout.fake_quant(v)
        for s in meta.query_starts[:-1]:
            kq[s:s + args.sink], vq[s:s + args.sink] = k[s:s + args.sink], v[s:s + args.sink]
        out = self._prefill(q, kq, vq, meta, cache)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    attention.PagedAttention.forward = forward


def patch_kv_clip(ratio: str) -> None:
    """The cache's own KV4 rounding of each row clamped to `ratio` of its range
    about the middle (or per row the least squared error of the grid)."""
    grid = [1.0, 0.95, 0.9, 0.85, 0.8] if ratio == "search" else [float(ratio)]
    quantize = kv_ref.quantize_kv4

    def quantize_kv4(x):
        xf = x.float()
        lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
        best = None
        for r in grid:
            mid, half = (hi + lo) / 2, (hi - lo) / 2 * r
            q = quantize(xf.clamp(mid - half, mid + half) if r < 1 else xf)
            err = (kv_ref.dequantize_kv4(*q, torch.float32) - xf).pow(2).sum(-1)
            if best is None:
                best = [err, *q]
                continue
            m = err < best[0]
            best = [torch.where(m, err, best[0]), torch.where(m[..., None], q[0], best[1]),
                    torch.where(m, q[1], best[2]), torch.where(m, q[2], best[3])]
        return best[1], best[2], best[3]

    kv_ref.quantize_kv4 = quantize_kv4


def patch_down_rotation(mode: str) -> None:
    """down_proj's input a -> a Q (Q = diag(signs) H / sqrt(I), seeded per layer)
    on every call, W -> W Q, after the residual rotation."""
    rotate = pipeline.rotate_model

    def rotate_model(model, seed=0, q=None):
        rotate(model, seed=seed, q=q)
        inter = model.layers[0].mlp.down_proj.in_features
        h = hadamard_matrix(inter)
        gen = torch.Generator().manual_seed(seed + 4)
        for layer in model.layers:
            signs = torch.randint(0, 2, (inter,), generator=gen).double() * 2 - 1
            rot = signs[:, None] * h / inter ** 0.5
            down = layer.mlp.down_proj
            down.weight.data.copy_(down.weight.data.double() @ rot)
            down.register_buffer("_r4", rot.float())
            down.register_forward_pre_hook(lambda m, a: (a[0] @ m._r4.to(a[0].dtype),))

    def reorder_down(layer, act_absmax):
        down = layer.mlp.down_proj
        if mode == "plain":
            return torch.arange(down.in_features)
        perm = torch.argsort(act_absmax.to(down.weight.device), descending=True, stable=True)
        down._r4.copy_(down._r4[:, perm])
        down.weight.data.copy_(down.weight.data[:, perm])
        return perm

    def smooth_down(layer, act_absmax, alpha):
        down = layer.mlp.down_proj
        if mode == "plain":
            return torch.ones(down.in_features, dtype=torch.float64)
        s = smooth_scales(act_absmax, down.weight.detach().abs().amax(dim=0), alpha)
        down._r4.copy_(down._r4.double() / s[None, :])
        down.weight.data.copy_(down.weight.data.double() * s[None, :])
        return s

    pipeline.rotate_model, pipeline.reorder_down, pipeline.smooth_down = rotate_model, reorder_down, smooth_down


def main():
    args = parse_args()
    cfg = get_preset(args.preset, **{k: ast.literal_eval(v) for k, v in
                                     (item.split("=", 1) for item in args.set)})
    if args.kv != "kv" or args.sink or args.kmean or args.qk_had:
        patch_attention(args)
    if args.down_rotation:
        patch_down_rotation(args.down_rotation)
    src = load_model_source(None)
    ids = src.tokenizer.encode(read_texts(list(LICENSE_TEXTS)))
    ids = ids[:args.tokens] if args.tokens else ids
    calib = load_calibration(src.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
    start = time.time()
    result = pipeline.quantize_model(src, cfg, calib, progress=False)
    if args.kv_clip:  # after quantizing: only the cache's rounding changes
        patch_kv_clip(args.kv_clip)
    extra = {}
    if args.kl:
        fp_cfg = dataclasses.replace(cfg, w_bits=16, a_bits=16, kv_bits=16, scale_tuning_epochs=0)
        fp = pipeline.build_fp_model(src, fp_cfg, "cpu")
        d = kl.compare(fp.prompt_logits, result.model.prompt_logits, ids, 512, 512)
        ppl, extra = d.ppl, dict(fp_ppl=round(d.ref_ppl, 3), kl=round(d.kl_mean, 4), kl_p99=round(d.kl_p99, 3),
                                 same_top=round(d.same_top, 4))
    else:
        ppl = perplexity(result.model.prompt_logprobs, ids, 512, 512).ppl
    print(json.dumps(dict(preset=args.preset, set=args.set, kv=args.kv, sink=args.sink,
                          kmean=args.kmean, qk_had=args.qk_had, kv_clip=args.kv_clip,
                          down_rotation=args.down_rotation, tokens=len(ids), ppl=round(ppl, 3), **extra,
                          alpha_attn=[i.get("alpha_attn") for i in result.layer_info],
                          seconds=round(time.time() - start))), flush=True)


if __name__ == "__main__":
    main()
