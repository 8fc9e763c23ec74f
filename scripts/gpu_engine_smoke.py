"""Stage 5 of scripts/gpu_check.sh: the engine end to end on the Triton path
(W4A8 GEMM, fused activation quantization, KV4 write and decode) against
the torch path on CPU, on synthetic QoQ models (no downloads, no
tokenizer files), through the public LLM API only.

Each model and dtype runs twice on the device: as served (decode steps in
CUDA graphs, engine/graphed_decode.py; the row says which sizes were
captured) and with enforce_eager. fp32 runs must give the same greedy
tokens and logprobs within --atol, and the graphed run the eager run's
tokens; fp16 runs are reported (tokens may part after a near-tie, logprob
drift). Exit 1 if any fp32 comparison fails or a run crashes.

    python3 scripts/gpu_engine_smoke.py --device cuda --out engine_smoke.json
On CPU (a smoke test of this script) TRITON_INTERPRET=1 --device cpu.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

PROMPTS = [[1, 5, 9, 200, 33, 7], [4, 4, 100, 17], list(range(3, 40)), [7] * 70]


def compare(ref, got, atol: float) -> dict:
    """Greedy outputs of one prompt set: equal token ids, logprobs within atol
    (over the common prefix when the tokens part)."""
    equal = [r.token_ids == g.token_ids for r, g in zip(ref, got)]
    worst = 0.0
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b),
                 min(len(r.token_ids), len(g.token_ids)))
        for a, b in zip((r.logprobs or [])[:n + 1], (g.logprobs or [])[:n + 1]):
            worst = max(worst, abs(a - b))
    return {"tokens_equal": all(equal) and len(ref) == len(got), "per_prompt_equal": equal,
            "max_logprob_diff": worst, "ok": all(equal) and len(ref) == len(got) and worst <= atol}


def generate(model: str, device: str, kernels: str, dtype: str, max_tokens: int, prompts=PROMPTS,
             enforce_eager: bool = False):
    from qoqserve.llm import LLM
    from qoqserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    # 4 sequences, chunks of 64: the 70-token prompt is prefilled in two, and
    # the Gemma models' sliding layers get a page pool of their own (engine/window_pages.py)
    llm = LLM(model, dtype=dtype, kernels=kernels, device=device, num_blocks=128, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=enforce_eager)
    load = time.perf_counter() - t0
    stats = llm.engine.stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, {"kv_kernel": stats.get("kv_kernel"), "linear_paths": sorted(set(stats.get("linear_paths", []))),
                  "captured_decode_sizes": stats.get("captured_decode_sizes"),
                  "window_kv_blocks": stats.get("num_window_kv_blocks"), "load_seconds": load,
                  "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    # tiny-gemma3: GeGLU, sandwich norms, sliding-window layers (window 32: the 70-token prompt passes it);
    # tiny-gemma2: those and soft-capped scores and logits
    p.add_argument("--models", nargs="+", default=["synthetic:tiny:qoq-g64", "synthetic:tiny:qoq-chn",
                                                   "synthetic:tiny-qwen3:qoq-g64", "synthetic:tiny-gemma3:qoq-g64",
                                                   "synthetic:tiny-gemma2:qoq-g64", "synthetic:smollm2-135m:qoq-g64"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--atol", type=float, default=2e-3)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report, failed = [], False
    prompts = PROMPTS[:args.num_prompts]
    for model in args.models:
        try:
            ref, ref_info = generate(model, "cpu", "torch", "float32", args.max_tokens, prompts)
        except Exception as e:
            report.append({"model": model, "error": f"CPU reference: {type(e).__name__}: {e}"})
            failed = True
            continue
        for dtype in args.dtypes:
            runs = {}
            for mode in ("graphed", "eager"):
                row = {"model": model, "dtype": dtype, "mode": mode, "reference": ref_info}
                try:
                    got, info = generate(model, args.device, "triton", dtype, args.max_tokens, prompts,
                                         enforce_eager=mode == "eager")
                    runs[mode] = got
                    row.update(info=info, **compare(ref, got, args.atol))
                    if mode == "eager" and "graphed" in runs:
                        row["graphed_equals_eager"] = compare(got, runs["graphed"], args.atol)
                        row["ok"] &= row["graphed_equals_eager"]["tokens_equal"]
                    failed |= dtype == "float32" and not row["ok"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                    failed = True
                report.append(row)
                print(json.dumps(row), flush=True)
                if args.out:  # rewritten after every row: a later crash keeps what is known
                    with open(args.out, "w") as f:
                        json.dump(report, f, indent=2)
    print("# engine smoke:", "FAILED" if failed else "ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
