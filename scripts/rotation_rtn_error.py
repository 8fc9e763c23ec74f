#!/usr/bin/env python
"""Why rotation hurts round-to-nearest on the embedded model: the relative
output error of each linear under QoQ RTN g64 weights, with the real
activations of one 256-token calibration sample, before and after the
block-input rotation (weights only; activations and KV stay exact)."""
import torch

from qoqserve.layers.linear import Linear
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import _qoq_rtn, build_fp_model
from qoqserve.quant.transforms.rotation import rotate_model


def output_errors(model, ids):
    errs, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            def hook(m, args, name=name):
                x, w = args[0].float(), m.weight.detach().float()
                y = x @ w.T
                errs[name] = ((y - x @ _qoq_rtn(w, 64).T).norm() / y.norm()).item()
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


if __name__ == "__main__":
    main()
