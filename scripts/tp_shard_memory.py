"""Peak memory of each tensor-parallel rank after loading (docs/parallel.md):
a rank should hold, and read, about its shard. Exports MODEL to safetensors
once, or (--format gguf) loads the GGUF file itself (the embedded model's by
default), at each tensor-parallel size, and prints every rank's VmHWM /
RssAnon / RssFile.

    python scripts/tp_shard_memory.py [--model MODEL] [--format safetensors|gguf] [--tp 1 3] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import tempfile


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def main() -> None:
    from qoqserve.llm import LLM
    from qoqserve.model_loader import default_gguf_path
    from qoqserve.model_loader.export import export_hf_dir

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.format == "gguf":
            path = args.model or default_gguf_path()
            size = os.path.getsize(path)
            print(f"checkpoint {path}: {size / 2**20:.1f} MiB (GGUF, loaded as {args.dtype})")
        else:
            path = export_hf_dir(args.model, os.path.join(tmp, "model"), args.dtype)
            size = os.path.getsize(os.path.join(path, "model.safetensors"))
            print(f"checkpoint {size / 2**20:.1f} MiB ({args.dtype})")
        print("| tp | rank | weights MiB | VmHWM MiB | RssAnon MiB | RssFile MiB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for tp in args.tp:
            llm = LLM(path, dtype=args.dtype, tensor_parallel_size=tp, num_blocks=16, max_model_len=256,
                      enforce_eager=True)
            weights = llm.engine.stats()["weight_bytes"]
            pids = [os.getpid()] + (llm.engine.executor.pids if llm.engine.executor else [])
            for rank, pid in enumerate(pids):
                s = status(pid)
                w = f"{weights / 2**20:.1f}" if rank == 0 else ""
                print(f"| {tp} | {rank} | {w} | {s['VmHWM'] / 2**20:.1f} | {s['RssAnon'] / 2**20:.1f} | "
                      f"{s['RssFile'] / 2**20:.1f} |", flush=True)
            llm.shutdown()
            del llm


if __name__ == "__main__":
    main()
