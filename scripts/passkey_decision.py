"""Where a quantized model loses the free pass key, fast: the decision token.

In the free protocol (`eval quality`'s passkey-free) every reply measured
starts "The pass key is"; the case is decided by the next token, " " (the
lone space this tokenizer writes before digits) or " a" ("a small wooden
door ..."). Teacher-forcing "The pass key is" and reading that one row gives
the free protocol's outcome (the same shares as generating, checked for FP
and the default recipe) plus a margin, logit(" ") - logit(" a"), averaged
per length: a continuous number where 20 keys give only steps of 5%. One
prompt pass per case, no decoding, so a recipe and seed take one
quantization plus ~1.5 minutes here.

    python scripts/passkey_decision.py fp
    python scripts/passkey_decision.py g64 g64:seed=1 "g64:calib_seq_len=2048,calib_samples=128"
    python scripts/passkey_decision.py --kv4-layers 0-4 5-9 10-14   # FP weights, KV4 on those layers only

Each config is a preset and QuantConfig overrides (Python literals); each
line prints the calibration windows, perplexity on the first 4,096 license
tokens (512-token windows) and, per length, (decided share, mean margin).
"""
import argparse
import time
from dataclasses import replace

from qoqserve.eval import retrieval
from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import calibration_for
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model, quantize_model

LONGEST = 2200


def decision(logits_fn, tok, cases) -> dict[int, tuple[float, float]]:
    prefix = tok.encode("The pass key is", add_special_tokens=False)
    space = tok.encode(" ", add_special_tokens=False)[0]
    word = tok.encode(" a", add_special_tokens=False)[0]
    per: dict[int, list[tuple[bool, float]]] = {}
    for c in cases:
        ids = c.ids + prefix
        row = logits_fn(ids, [len(ids) - 1])[0].float()
        per.setdefault(c.length, []).append((int(row.argmax()) == space, float(row[space] - row[word])))
    return {n: (sum(d for d, _ in v) / len(v), round(sum(m for _, m in v) / len(v), 3)) for n, v in per.items()}


def parse(spec: str):
    preset, _, rest = spec.partition(":")
    over = eval(f"dict({rest})") if rest else {}  # a developer's own command line
    return replace(get_preset(preset, **over), name=spec)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", help="'fp' or PRESET[:FIELD=VALUE,...]")
    p.add_argument("--kv4-layers", nargs="*", default=None, metavar="A-B",
                   help="FP weights (rotation + key transform) with KV4 on these layer ranges only")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    args = p.parse_args()
    src = load_model_source(None)
    tok = src.tokenizer
    cases = retrieval.build_free_cases(tok, tuple(args.lengths))
    ids = tok.encode(read_texts(LICENSE_TEXTS))[:4096]

    def report(name, model, calib=None, seconds=None):
        ppl = perplexity(model.prompt_logprobs, ids, 512, 512).ppl
        print(f"{name}: {calib.describe() if calib else 'no calibration'}, ppl4k {ppl:.3f}, "
              f"decision {decision(model.prompt_logits, tok, cases)}"
              + (f", quantized in {seconds:.0f} s" if seconds else ""), flush=True)

    for spec in args.configs:
        if spec == "fp":
            report("fp", build_fp_model(src, get_preset("rtn-kv4", kv_bits=16), "cpu", LONGEST))
            continue
        cfg = parse(spec)
        calib = calibration_for(tok, None, cfg)
        res = quantize_model(src, cfg, calib, progress=False, max_positions=LONGEST)
        report(spec, res.model, calib, res.seconds)
    if args.kv4_layers is not None:
        cfg = replace(get_preset("rtn-kv4"), rotate=True, key_transform=True)
        model = quantize_model(src, cfg, calibration_for(tok, None, cfg), progress=False,
                               max_positions=LONGEST).model
        kv4 = [layer.self_attn.attn.layout for layer in model.layers]

        class Exact:  # the same pages, read back exactly
            def __init__(self, layout):
                self.layout = layout

            def fake_quant(self, x):
                return x

            def __getattr__(self, name):
                return getattr(self.layout, name)
        for spec in args.kv4_layers or ["0-29"]:
            a, _, b = spec.partition("-")
            on = range(int(a), int(b or a) + 1)
            for i, layer in enumerate(model.layers):
                layer.self_attn.attn.layout = kv4[i] if i in on else Exact(kv4[i])
            start = time.time()
            print(f"KV4 on layers {spec}: decision {decision(model.prompt_logits, tok, cases)} "
                  f"({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
