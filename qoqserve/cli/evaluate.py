"""`qoqserve eval ppl | accuracy | quality`: perplexity of text files, the accuracy and quality tables."""
from __future__ import annotations

import json

from qoqserve.cli.engine_args import add_engine_args, make_engine
from qoqserve.eval import accuracy, quality


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model")
    esub = p.add_subparsers(dest="eval_command", required=True)
    ppl = esub.add_parser("ppl", help="perplexity of text files (concatenated)")
    ppl.add_argument("files", nargs="*", help="text files (default: the GPL-3 and Apache-2.0 "
                                             "license texts in /usr/share/common-licenses)")
    ppl.add_argument("--window", type=int, default=512, help="tokens of context per forward pass")
    ppl.add_argument("--stride", type=int, default=None, help="window step (default: = window)")
    ppl.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_args(ppl)
    ppl.set_defaults(func=run_ppl)
    acc = esub.add_parser("accuracy", help="perplexity of every quantization config (docs/accuracy.md)")
    accuracy.register_args(acc)
    acc.set_defaults(func=accuracy.run_cmd)
    qual = esub.add_parser("quality", help="perplexity, KL vs FP, greedy agreement, pass-key retrieval "
                                           "and JSON format following of configurations (docs/quality.md)")
    quality.register_args(qual)
    qual.set_defaults(func=quality.run_cmd)


def run_ppl(args) -> int:
    # lazy: CLI start-up
    from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts

    args.kv_cache_gb = args.kv_cache_gb or 0.05  # scratch pages for one window
    args.quantized_prefill = True  # every position sees K/V as the cache stores them
    engine = make_engine(args, args.model)
    files = args.files or list(LICENSE_TEXTS)
    ids = engine.tokenizer.encode(read_texts(files))
    stride = args.stride or args.window
    res = perplexity(engine.prompt_logprobs, ids, args.window, stride, progress=not args.json)
    if args.json:
        print(json.dumps({"ppl": res.ppl, "nll": res.nll, "tokens": res.num_tokens,
                          "window": res.window, "stride": res.stride, "files": files}))
    else:
        print(f"perplexity {res.ppl:.4f} over {res.num_tokens} tokens "
              f"(window {res.window}, stride {res.stride}, {len(files)} file(s), "
              f"dtype {engine.runner.dtype})")
    return 0
