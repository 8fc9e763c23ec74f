"""`qoqserve generate`: one prompt or chat message, streamed to the terminal."""
from __future__ import annotations

import sys
import time

from qoqserve.cli.engine_args import add_engine_args, make_engine
from qoqserve.sampling_params import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt or a chat message")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw completion prompt")
    src.add_argument("--chat", help="user message, wrapped in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampler")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    engine = make_engine(args, args.model)
    tok = engine.tokenizer
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.chat})
        prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    else:
        prompt = args.prompt
    start = time.perf_counter()
    engine.add_request("cli", prompt, params)
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    if out is not None:
        n = len(out.token_ids)
        print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, "
              f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
