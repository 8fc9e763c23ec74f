"""`qoqserve quantize`: a checkpoint -> a QoQ W4A8KV4 checkpoint."""
from __future__ import annotations

import dataclasses
import sys

# QuantConfig switches that get --STEP / --no-STEP flags
STEP_FLAGS = ("rotate", "smooth_attention", "key_transform", "smooth_out", "reorder", "clip", "gptq",
              "group_search", "true_sequential", "asymmetric_calibration", "rotation_act_quant", "rotation_kv_quant",
              "rotation_lr_decay", "scale_tuning_norms")
# the learned rotation's training (--rotation learned), each a QuantConfig field
ROTATION_OPTIONS = (("rotation_steps", int), ("rotation_lr", float), ("rotation_samples", int),
                    ("rotation_seq_len", int), ("rotation_batch", int))
# end-to-end scale tuning after quantization (quant/scale_tuning.py)
TUNING_OPTIONS = (("scale_tuning_epochs", int), ("scale_tuning_lr", float), ("scale_tuning_windows", int))


def add_quant_args(p) -> None:
    p.add_argument("--config", default="g64",
                   help="g128 | g64 | chn | g64-tuned (g64 with the long scale tuning: 2 epochs over every "
                        "window), or a baseline preset")
    p.add_argument("--calib", default=None, help="calibration text file (default: shipped set)")
    p.add_argument("--calib-samples", type=int, default=None)
    p.add_argument("--calib-seq-len", type=int, default=None)
    p.add_argument("--calib-long-samples", type=int, default=None,
                   help="calibration windows of --calib-long-seq-len tokens besides the short ones "
                        "(0: none)")
    p.add_argument("--calib-long-seq-len", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the Hadamard rotations (residual stream, keys); one seed's perplexity "
                        "moves by about 2%% against another's (docs/accuracy.md)")
    p.add_argument("--kv-bits", type=int, choices=[4, 16], default=None)
    p.add_argument("--smooth-alpha", type=float, default=None, help="fixed migration strength")
    p.add_argument("--w8a8-linears", nargs="+", default=None, metavar="PATTERN",
                   help="keep these linears at W8A8 (mixed recipe): fnmatch patterns over "
                        "layers.{i}.{self_attn.qkv_proj|self_attn.o_proj|mlp.gate_up_proj|mlp.down_proj}, "
                        "e.g. 'layers.0.*' '*.mlp.down_proj'")
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.quant.config import ROTATION_LOSSES, ROTATIONS, get_preset
    preset = get_preset("g64")  # g128 and chn tune alike
    p.add_argument("--rotation", choices=ROTATIONS, default=None,
                   help="residual rotation: a fixed Hadamard (default), or learned from the Hadamard "
                        "start on the calibration text against the fake-quantized model")
    for field, kind in ROTATION_OPTIONS:
        p.add_argument("--" + field.replace("_", "-"), type=kind, default=None,
                       help="learned rotation training (QuantConfig." + field + ")")
    p.add_argument("--scale-tuning-epochs", type=int, default=None,
                   help="after quantizing, tune the float scales (s1, norm weights) by KL to the FP model "
                        "for this many passes over the tuning windows (0: off; the g64/g128/chn presets: "
                        f"{preset.scale_tuning_epochs}; docs/accuracy.md has what it gains and costs)")
    p.add_argument("--scale-tuning-windows", type=int, default=None,
                   help="how many calibration windows the tuning trains on, spread over the text "
                        f"(0: all; the g64/g128/chn presets: {preset.scale_tuning_windows})")
    p.add_argument("--scale-tuning-lr", type=float, default=None, help="its Adam learning rate")
    p.add_argument("--rotation-loss", choices=ROTATION_LOSSES, default=None,
                   help="learned rotation loss: KL to the FP model's logits, or next-token CE")
    for flag in STEP_FLAGS:
        step = flag.replace("_", "-")
        p.add_argument(f"--{step}", dest=flag, action="store_true", default=None,
                       help=f"force the {step} step on")
        p.add_argument(f"--no-{step}", dest=flag, action="store_false", help=f"skip {step}")


def quant_config_from_args(args):
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.quant.config import get_preset

    over = {}
    rotation = ("rotation", "rotation_loss") + tuple(f for f, _ in ROTATION_OPTIONS + TUNING_OPTIONS)
    for field in STEP_FLAGS + rotation + ("kv_bits", "smooth_alpha", "calib_samples", "calib_seq_len",
                                          "calib_long_samples", "calib_long_seq_len", "w8a8_linears", "seed"):
        value = getattr(args, field, None)
        if value is not None:
            over[field] = tuple(value) if isinstance(value, list) else value
    return get_preset(args.config, **over)


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model with QoQ (W4A8KV4)")
    p.add_argument("model", nargs="?", default=None,
                   help="HF dir, .gguf or a cached Hugging Face id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="the same, as a flag (vLLM's spelling)")
    p.add_argument("--tokenizer", default=None,
                   help="another tokenizer (HF dir, cached Hugging Face id, .gguf): the checkpoint keeps it")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory")
    p.add_argument("--eval", action="store_true",
                   help="print the perplexity of the result on the license texts")
    add_quant_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.model_loader import load_model_source
    from qoqserve.quant.calibration import calibration_for
    from qoqserve.quant.checkpoint import save_checkpoint
    from qoqserve.quant.pipeline import quantize_model

    cfg = quant_config_from_args(args)
    source = load_model_source(args.model_flag or args.model, args.tokenizer)
    calib = calibration_for(source.tokenizer, args.calib, cfg)
    print(f"quantizing {source.name} with {cfg.name}: "
          f"{', '.join(f'{k}={v}' for k, v in dataclasses.asdict(cfg).items() if k != 'smooth_alpha_grid')}",
          file=sys.stderr)
    print(f"calibration: {calib.describe()} from {calib.source}",
          file=sys.stderr)
    result = quantize_model(source, cfg, calib, args.device)
    save_checkpoint(result, source, calib, args.output)
    print(f"wrote {args.output} in {result.seconds:.1f}s (steps: {', '.join(result.steps)})")
    if args.eval:
        # lazy: CLI start-up (load what a subcommand needs when it runs)
        from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
        ids = source.tokenizer.encode(read_texts(LICENSE_TEXTS))
        res = perplexity(result.model.prompt_logprobs, ids, 512, 512)
        print(f"perplexity (simulation) {res.ppl:.4f} over {res.num_tokens} tokens")
    return 0
