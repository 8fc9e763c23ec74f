#!/usr/bin/env python
"""Why rotation hurts round-to-nearest on the embedded model.

1. The relative output error of each linear under QoQ RTN g64 weights, with
   the real activations of one 256-token calibration sample, before and after
   the block-input rotation (weights only; activations and KV stay exact).
2. W4A16 RTN g64 perplexity (first 4096 tokens of the license texts, 512
   windows) of the plain model, with the RMSNorm weights folded into the
   linears (what rotation needs first), and folded + rotated.
"""
import torch

from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.layers.linear import Linear
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model
from qoqserve.quant.sim import qoq_rtn
from qoqserve.quant.transforms.rotation import fold_norms, rotate_model


def output_errors(model, ids):
    errs, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            def hook(m, args, name=name):
                x, w = args[0].float(), m.weight.detach().float()
                y = x @ w.T
                errs[name] = ((y - x @ qoq_rtn(w, 64).T).norm() / y.norm()).item()
            hooks.append(mod.register_forward_pre_hook(hook))
    model.prompt_logprobs(ids)
    for h in hooks:
        h.remove()
    return errs


def main():
    src = load_model_source(None)
    ids = load_calibration(src.tokenizer, None, 2, 256).samples[0]
    with torch.no_grad():
        model = build_fp_model(src, get_preset("rtn-w4a8kv4-g64", kv_bits=16), "cpu")
        plain = output_errors(model, ids)
        rotate_model(model, seed=0)
        rotated = output_errors(model, ids)
    print("linear         relative output error, mean (max) over the 30 layers")
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        a = [v for k, v in plain.items() if k.endswith(kind)]
        b = [rotated[k] for k in plain if k.endswith(kind)]
        print(f"{kind:13s}  plain {sum(a) / len(a):.4f} ({max(a):.4f})   rotated {sum(b) / len(b):.4f} ({max(b):.4f})")


def rtn_ppl(src, ids, transform):
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    with torch.no_grad():
        model = build_fp_model(src, get_preset("rtn-w4a16-g64", kv_bits=16), "cpu")
        transform(model)
        for layer in model.layers:
            for n in names:
                lin = layer.get_submodule(n)
                lin.weight.data.copy_(qoq_rtn(lin.weight.data.float(), 64))
        return perplexity(model.prompt_logprobs, ids, 512, 512).ppl


def main_ppl():
    src = load_model_source(None)
    ids = src.tokenizer.encode(read_texts(LICENSE_TEXTS))[:4096]
    with torch.no_grad():
        fp = perplexity(build_fp_model(src, get_preset("rtn-w4a16-g64", kv_bits=16), "cpu")
                        .prompt_logprobs, ids, 512, 512).ppl
    print(f"FP32: {fp:.3f}")
    for label, fn in (("plain", lambda m: None), ("norms folded", fold_norms),
                      ("norms folded + rotated", lambda m: rotate_model(m, seed=0))):
        p = rtn_ppl(src, ids, fn)
        print(f"W4A16 RTN g64, {label}: {p:.3f} ({100 * (p / fp - 1):+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
    main_ppl()
