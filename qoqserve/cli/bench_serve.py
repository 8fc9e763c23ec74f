"""`qoqserve bench serve`: a load generator (or, with --soak, a soak test) for
any OpenAI-compatible server."""
from __future__ import annotations

import json


def register_serve(bsub) -> None:
    srv = bsub.add_parser("serve", help="load generator for any OpenAI-compatible server "
                                        "(throughput, TTFT, TPOT, ITL, e2e)")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000")
    srv.add_argument("--model", default=None, help="model id (default: the server's first)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    srv.add_argument("--num-requests", type=int, default=128)
    load = srv.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", default=None,
                      help="closed loop: N clients (default 32); several values run a sweep")
    load.add_argument("--request-rate", type=float, nargs="+", default=None,
                      help="open loop: Poisson req/s; several values run a sweep")
    srv.add_argument("--input-words", type=int, default=75, help="prompt length in words (~1.3 tokens each)")
    srv.add_argument("--input-jitter", type=float, default=0.0, help="uniform +- fraction")
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--output-jitter", type=float, default=0.0)
    srv.add_argument("--no-ignore-eos", action="store_true")
    srv.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    srv.add_argument("--top-p", type=float, default=None)
    srv.add_argument("--top-k", type=int, default=None)
    srv.add_argument("--min-p", type=float, default=None)
    srv.add_argument("--repetition-penalty", type=float, default=None)
    srv.add_argument("--logprobs", type=int, default=None, help="ask each token's logprob and this many most likely")
    srv.add_argument("--long-streams", type=int, default=0,
                     help="a mixed load: this many more clients send long prompts back to back "
                          "(latencies reported are the main load's)")
    srv.add_argument("--long-input-words", type=int, default=1500, help="their prompts (~2,000 tokens)")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--json-out", default=None)
    soak = srv.add_argument_group("soak (bench/soak.py): checks every answer instead of timing")
    soak.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                      help="run the load this long with garbage and hang-ups; report errors, p99, "
                           "RSS and KV pages over time (concurrency: the first --concurrency)")
    soak.add_argument("--garbage-frac", type=float, default=0.1, help="share of malformed bodies (must get 4xx)")
    soak.add_argument("--disconnect-frac", type=float, default=0.1, help="share of streams hung up early")
    soak.add_argument("--soak-interval", type=float, default=10.0, help="seconds between report rows")
    soak.add_argument("--server-pid", type=int, default=None,
                      help="read the server's RSS from /proc/PID/status (default: /health's rss_bytes)")
    srv.set_defaults(func=run_serve_cmd)


def run_soak_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.soak import SoakConfig, format_summary, run_soak

    cfg = SoakConfig(base_url=args.base_url, duration_s=args.soak, concurrency=(args.concurrency or [64])[0],
                     garbage_frac=args.garbage_frac, disconnect_frac=args.disconnect_frac,
                     output_len=min(args.output_len, 32), interval_s=args.soak_interval,
                     server_pid=args.server_pid, api_key=args.api_key, model=args.model, seed=args.seed)
    summary = run_soak(cfg)
    print(format_summary(summary), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["errors"] == 0 and not summary["leaked_blocks"] else 1


def run_serve_cmd(args) -> int:
    if args.soak is not None:
        return run_soak_cmd(args)
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.serve import LoadConfig, format_summary, run_load

    loads = ([(None, r) for r in args.request_rate] if args.request_rate
             else [(c, None) for c in (args.concurrency or [32])])
    summaries = []
    for concurrency, rate in loads:
        cfg = LoadConfig(base_url=args.base_url, model=args.model, api_key=args.api_key,
                         endpoint=args.endpoint, num_requests=args.num_requests,
                         concurrency=concurrency, request_rate=rate, input_words=args.input_words,
                         input_jitter=args.input_jitter, output_len=args.output_len,
                         output_jitter=args.output_jitter, ignore_eos=not args.no_ignore_eos,
                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty, logprobs=args.logprobs,
                         seed=args.seed, long_streams=args.long_streams,
                         long_input_words=args.long_input_words)
        summary = run_load(cfg)
        print(f"# {'rate %g req/s' % rate if rate else 'concurrency %d' % concurrency}")
        print(format_summary(summary), flush=True)
        summaries.append(summary)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summaries if len(summaries) > 1 else summaries[0], f, indent=2)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
