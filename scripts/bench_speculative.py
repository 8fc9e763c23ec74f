#!/usr/bin/env python
"""Speculative decoding with n-gram drafts against plain decoding, side by
side in one process: the same chat requests (greedy, the default W4A8KV4
model unless --model) through two engines, taking turns for --rounds rounds;
per workload and batch size the fastest round's decode tok/s of each, and
the drafts' acceptance. Outputs are checked equal (they must be).

Workloads: "copy" asks to repeat a paragraph (the output quotes the
prompt), "edit" to fix one word of a code snippet and give it back whole,
"free" to write a story (little for a lookup to find).

    OMP_NUM_THREADS=2 python scripts/bench_speculative.py [--batch 1 4] [--k 4]
"""
import argparse
import gc
import time

from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

PARAGRAPH = ("Lighthouses were built along dangerous coasts to guide ships at night. Each one had a "
             "distinct pattern of flashes, so that sailors could tell which light they saw and where "
             "they were. Keepers lived in small houses beside the towers, trimmed the wicks, cleaned "
             "the lenses and kept the lamps burning from dusk until dawn, in every kind of weather.")
CODE = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(valuez)\n\n\ndef spread(values):\n    return max(values) - min(values)\n")
WORKLOADS = {
    "copy": [f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
             f"Copy this paragraph without changing anything:\n\n{PARAGRAPH}"],
    "edit": [f"Fix the typo in this code and give back the whole code:\n\n{CODE}",
             f"Rename the function spread to value_range and give back the whole code:\n\n{CODE}"],
    "free": ["Write a short story about a fox who learns to swim.",
             "Write a story about a baker and a dragon who become friends."],
}


def chats(workload: str, batch: int) -> list[list[dict]]:
    base = WORKLOADS[workload]
    return [[{"role": "user", "content": base[i % len(base)]}] for i in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qoq")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: drawn, seeded (--seed)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=spec)}
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature else None)
    how = f"temperature {args.temperature}, top_p {args.top_p}, seed {args.seed}" if args.temperature else "greedy"
    print(f"# model {args.model}, {how}, max_tokens {args.max_tokens}, speculative_config {spec}, "
          f"best of {args.rounds} rounds taking turns")
    print("| workload | batch | tokens out | plain tok/s | ngram tok/s | speed-up | drafts accepted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for workload in WORKLOADS:
        for b in args.batch:
            convs = chats(workload, b)
            best = {name: 0.0 for name in engines}
            outs = {}
            spec_stats = engines["ngram"].engine.speculator
            d0, a0 = spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens
            for name, llm in engines.items():  # warm-up: the first run of a shape
                outs[name] = [o.token_ids for o in llm.chat(convs, params)]
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    t = time.perf_counter()
                    res = llm.chat(convs, params)
                    el = time.perf_counter() - t
                    best[name] = max(best[name], sum(len(o.token_ids) for o in res) / el)
            if outs["plain"] != outs["ngram"]:
                raise SystemExit(f"{workload} batch {b}: outputs differ with drafts")
            drafted = spec_stats.num_draft_tokens - d0
            accepted = spec_stats.num_accepted_tokens - a0
            n_out = sum(len(t) for t in outs["plain"])
            print(f"| {workload} | {b} | {n_out} | {best['plain']:.1f} | {best['ngram']:.1f} | "
                  f"{best['ngram'] / best['plain']:.2f}x | {accepted}/{drafted} "
                  f"({100 * accepted / max(drafted, 1):.0f}%) |", flush=True)
    del engines
    gc.collect()


if __name__ == "__main__":
    main()
