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
The KeyTransform that came out of these (`key_transform=True`) needs no patch.
"""
import argparse
import ast
import json
import time

from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.layers import attention
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.hadamard import hadamard_matrix
from qoqserve.quant.pipeline import quantize_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset")
    p.add_argument("--set", nargs="*", default=[], help="QuantConfig overrides, e.g. rotate=True")
    p.add_argument("--kv", choices=["kv", "k", "v"], default="kv")
    p.add_argument("--sink", type=int, default=0)
    p.add_argument("--kmean", action="store_true")
    p.add_argument("--qk-had", action="store_true")
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


def main():
    args = parse_args()
    cfg = get_preset(args.preset, **{k: ast.literal_eval(v) for k, v in
                                     (item.split("=", 1) for item in args.set)})
    if args.kv != "kv" or args.sink or args.kmean or args.qk_had:
        patch_attention(args)
    src = load_model_source(None)
    ids = src.tokenizer.encode(read_texts(list(LICENSE_TEXTS)))
    ids = ids[:args.tokens] if args.tokens else ids
    calib = load_calibration(src.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
    start = time.time()
    result = quantize_model(src, cfg, calib, progress=False)
    ppl = perplexity(result.model.prompt_logprobs, ids, 512, 512).ppl
    print(json.dumps(dict(preset=args.preset, set=args.set, kv=args.kv, sink=args.sink,
                          kmean=args.kmean, qk_had=args.qk_had, tokens=len(ids), ppl=round(ppl, 3),
                          alpha_attn=[i.get("alpha_attn") for i in result.layer_info],
                          seconds=round(time.time() - start))), flush=True)


if __name__ == "__main__":
    main()
