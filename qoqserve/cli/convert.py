"""`qoqserve convert`: a model as a plain HF safetensors directory."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("convert", help="write a model (e.g. a GGUF file) as an HF safetensors directory")
    p.add_argument("model", nargs="?", default=None, help="default: the embedded model")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.model_loader.export import export_hf_dir

    print(f"wrote {export_hf_dir(args.model, args.out, args.dtype)}")
    return 0
