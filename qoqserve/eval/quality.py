"""Configurations against the FP model on the same text and tasks, beyond
perplexity (docs/quality.md; `eval accuracy` runs it over docs/accuracy.md's
tables).

    qoqserve eval quality --configs rtn-w8a8 g64 --engine qoq --out q.md --json q.json

Per configuration (quantized in memory, measured through the fake-quant
simulation as `eval accuracy` does) and per runtime engine (`--engine`, a
checkpoint run by the serving kernels, KV4 pages included):
perplexity and KL divergence / same-top vs FP on the license texts
(eval/kl.py), greedy agreement with FP on chat prompts (eval/agreement.py),
pass-key retrieval per context length (eval/retrieval.py), and JSON format
following (eval/format_following.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field

from qoqserve.eval import agreement, format_following, kl, retrieval
from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.eval.quality_table import TASKS, to_markdown
from qoqserve.eval.subject import Subject, engine_subject, model_subject
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import calibration_for
from qoqserve.quant.config import ROTATIONS, QuantConfig, get_preset, with_rotation, with_seeds
from qoqserve.quant.pipeline import build_fp_model, quantize_model

DEFAULT_CONFIGS = ("rtn-w8a8", "rtn-w4a8kv4-g64", "g64", "chn")


@dataclass
class QualityOptions:
    texts: tuple[str, ...] = LICENSE_TEXTS
    window: int = 512
    stride: int = 512
    lengths: tuple[int, ...] = retrieval.DEFAULT_LENGTHS
    depths: tuple[float, ...] = retrieval.DEFAULT_DEPTHS
    keys_per_depth: int = 2
    free_keys_per_depth: int = retrieval.FREE_KEYS_PER_DEPTH
    greedy_tokens: int = 32
    seed: int = 0
    tasks: tuple[str, ...] = TASKS  # which of TASKS to measure
    # False: FP is only the reference (its own pass-key and JSON rows are not
    # measured), for splitting one table over several processes
    fp_row: bool = True


class Memo:
    """A subject's logits, kept after the first call per (ids, rows): the FP
    scores of the KL text are computed once for every configuration
    (fp32: ~2 GB for the license texts; recomputing costs a pass per row)."""

    def __init__(self, fn):
        self.fn, self.seen = fn, {}

    def __call__(self, ids, rows=None):
        key = (tuple(ids), None if rows is None else tuple(rows))
        if key not in self.seen:
            self.seen[key] = self.fn(ids, rows)
        return self.seen[key]


@dataclass
class Tasks:
    """Everything every subject is measured on, built once."""
    ids: list[int]
    chat: list[list[int]]
    references: list[list[int]]      # FP's greedy continuations of chat
    cases: list[retrieval.PasskeyCase]
    free_cases: list[retrieval.FreePasskeyCase]
    fp: Subject
    fp_ppl: float
    fp_kl: Memo
    rows: list[dict] = field(default_factory=list)


def measure(subject: Subject, tasks: Tasks, opts: QualityOptions, tokenizer, progress: bool) -> dict:
    start = time.perf_counter()
    row: dict = {"config": subject.name, **provenance()}
    if subject is tasks.fp:
        row.update(ppl=tasks.fp_ppl, kl_mean=0.0, kl_p99=0.0, same_top=1.0)
    else:
        d = kl.compare(tasks.fp_kl, subject.logits, tasks.ids, opts.window, opts.stride, progress)
        row.update(ppl=d.ppl, kl_mean=d.kl_mean, kl_median=d.kl_median, kl_p99=d.kl_p99, same_top=d.same_top)
    row["ppl_delta"] = row["ppl"] / tasks.fp_ppl - 1
    if "greedy" in opts.tasks:
        g = agreement.greedy_agreement(subject.logits, tasks.chat, tasks.references, opts.greedy_tokens)
        row.update(greedy_agreement=g.rate, greedy_prefix=g.mean_prefix)
    if "passkey" in opts.tasks:
        row["passkey"] = retrieval.passkey_accuracy(subject.logits, tasks.cases)
    if "passkey-free" in opts.tasks:
        row["passkey_free"], row["passkey_free_replies"] = retrieval.free_passkey_accuracy(
            subject.generate, tokenizer, tasks.free_cases)
    if "json" in opts.tasks:
        f = format_following.format_following(subject.generate, tokenizer)
        row.update(json_rate=f.rate, json_parsed=f.parsed, json_replies=f.replies)
    row.update(subject.info, eval_seconds=time.perf_counter() - start)
    print(one_line(row), flush=True)
    return row


def one_line(r: dict) -> str:
    line = (f"{r['config']}: ppl {r['ppl']:.3f} ({100 * r['ppl_delta']:+.1f}%) KL {r['kl_mean']:.4f} "
            f"p99 {r['kl_p99']:.3f} top1 {100 * r['same_top']:.1f}%")
    if "greedy_agreement" in r:
        line += f" greedy {100 * r['greedy_agreement']:.0f}%"
    if "passkey" in r:
        line += " passkey " + " ".join(f"{k}:{100 * v:.0f}%" for k, v in r["passkey"].items())
    if "passkey_free" in r:
        line += " free " + " ".join(f"{k}:{100 * v:.0f}%" for k, v in r["passkey_free"].items())
    if "json_rate" in r:
        line += f" json {100 * r['json_rate']:.0f}%"
    return line


def provenance() -> dict:
    """When, at which commit and under what load a row was measured."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def _as_json(value):
    """value as a JSON round trip gives it back (tuples as lists), to compare with a loaded table."""
    return json.loads(json.dumps(value))


def _reusable(earlier: dict | None, table: dict) -> dict[str, dict]:
    """The config rows of an earlier table (by name) measured on the same model
    with the same options."""
    if earlier:  # a table written before an option existed ran with its default
        earlier = {**earlier, "options": {**_as_json(asdict(QualityOptions())), **earlier.get("options", {})}}
    same = earlier and all(earlier.get(k) == _as_json(table[k]) for k in ("model", "options"))
    if not same:
        return {}
    # likewise a row quantized before a QuantConfig field existed ran with its default
    defaults = _as_json(asdict(QuantConfig()))
    return {r["config"]: {**r, "quant_config": {**defaults, **r["quant_config"]}}
            for r in earlier["rows"] if "quant_config" in r}


def run_quality(model: str | None, configs, engines=(), opts: QualityOptions = QualityOptions(),
                progress: bool = True, on_row=None, reuse=None) -> dict:
    """configs: QuantConfigs simulated in memory; engines: checkpoint paths or
    aliases ('qoq') run by the runtime engine. Returns the table as a dict;
    on_row(table so far) after each row (a long run keeps what it measured).
    reuse: an earlier table (as JSON holds it); a config it measured with the
    same settings and options is taken from it, not measured again. A config that
    cannot quantize this model gets a row saying why."""
    source = load_model_source(model)
    tok, eos = source.tokenizer, source.arch.eos_token_ids
    cases = (retrieval.build_cases(tok, opts.lengths, opts.depths, opts.keys_per_depth, opts.seed)
             if "passkey" in opts.tasks else [])
    free_cases = (retrieval.build_free_cases(tok, opts.lengths, opts.depths, opts.free_keys_per_depth, opts.seed)
                  if "passkey-free" in opts.tasks else [])
    longest = max([opts.window] + [len(c.ids) for c in cases]
                  + [len(c.ids) + retrieval.FREE_MAX_NEW_TOKENS for c in free_cases])
    fp_model = build_fp_model(source, get_preset("rtn-kv4", kv_bits=16), "cpu", longest)
    fp = model_subject("FP32", fp_model, eos)
    ids = tok.encode(read_texts(opts.texts))
    chat = agreement.chat_prompt_ids(tok)
    references = fp.generate(chat, opts.greedy_tokens) if "greedy" in opts.tasks else []
    tasks = Tasks(ids, chat, references, cases, free_cases, fp,
                  perplexity(fp_model.prompt_logprobs, ids, opts.window, opts.stride).ppl, Memo(fp.logits))
    table = {"model": model or "embedded SmolLM2-135M-Instruct", "options": asdict(opts),
             "ppl_tokens": len(ids) - 1, "rows": tasks.rows}

    def add(row):
        tasks.rows.append(row)
        if on_row:
            on_row(table)
    if opts.fp_row:
        add(measure(fp, tasks, opts, tok, progress))
    earlier = _reusable(reuse, table)
    for cfg in configs:
        settings = _as_json(cfg.to_dict())
        if cfg.name in earlier and earlier[cfg.name]["quant_config"] == settings:
            print(f"{cfg.name}: measured earlier, kept", flush=True)
            add(earlier[cfg.name])
            continue
        try:
            cfg.check_model(source.arch)
        except ValueError as e:
            print(f"{cfg.name}: not applicable: {e}", flush=True)
            add({"config": cfg.name, "not_applicable": str(e), "quant_config": settings, **provenance()})
            continue
        calib = calibration_for(tok, None, cfg)
        result = quantize_model(source, cfg, calib, progress=progress, max_positions=longest)
        subject = model_subject(cfg.name, result.model, eos, quantize_seconds=result.seconds,
                                steps=result.steps)
        add({**measure(subject, tasks, opts, tok, progress), "quant_config": settings})
        del result, subject
    for path in engines:
        # every position attends to K/V as the pages store them, as the simulation does
        llm = LLM(path, quantized_prefill=True, kv_cache_gb=0.25)
        add(measure(engine_subject(f"engine {path}", llm), tasks, opts, tok, progress))
        del llm
    return table


def register_args(p) -> None:
    p.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS),
                   help=f"presets simulated in memory (default: {' '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--engine", nargs="*", default=[], metavar="MODEL",
                   help="checkpoints (or the 'qoq' alias) measured through the runtime engine")
    p.add_argument("--model", default=None, help="the FP model (default: the embedded one)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(retrieval.DEFAULT_LENGTHS),
                   help="pass-key prompt lengths in tokens (default: 1024 2048; the embedded "
                        "model takes up to 8192, ~4x slower per doubling on CPU)")
    p.add_argument("--keys-per-depth", type=int, default=2,
                   help=f"pass keys per length and depth (depths {retrieval.DEFAULT_DEPTHS})")
    p.add_argument("--free-keys-per-depth", type=int, default=retrieval.FREE_KEYS_PER_DEPTH,
                   help="the free protocol's pass keys per length and depth")
    p.add_argument("--window", type=int, default=512, help="perplexity / KL window")
    p.add_argument("--stride", type=int, default=None,
                   help="window step (default: = window, disjoint; window/2 scores each token "
                        "with at least window/2 of context, as llama.cpp's perplexity does)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="K of greedy agreement")
    p.add_argument("--tasks", nargs="*", choices=TASKS, default=list(TASKS),
                   help="what to measure besides perplexity, KL and same top (default: all; "
                        "none: those three alone, as llama.cpp's perplexity --kl-divergence)")
    p.add_argument("--no-fp-row", dest="fp_row", action="store_false",
                   help="measure FP only as the reference, not as a row of its own")
    p.add_argument("--seeds", type=int, nargs="*", default=[],
                   help="quantize each config once per seed (its Hadamard rotations), a row each: "
                        "one seed's pass keys and perplexity can sit far from another's")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--json", default=None, help="write the whole table (and every JSON reply) here")
    p.add_argument("--rotation", choices=ROTATIONS, default=None,
                   help="run the rotating configs with this residual rotation (default: their own; "
                        "'learned' trains it per config, docs/accuracy.md)")


def run_cmd(args) -> int:
    opts = QualityOptions(window=args.window, stride=args.stride or args.window, lengths=tuple(args.lengths),
                          keys_per_depth=args.keys_per_depth,
                          free_keys_per_depth=args.free_keys_per_depth, greedy_tokens=args.greedy_tokens,
                          tasks=tuple(args.tasks),
                          fp_row=args.fp_row)

    def write(table):
        if args.out:
            with open(args.out, "w") as f:
                f.write(to_markdown(table) + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table, f, indent=1)
    configs = with_seeds(with_rotation([get_preset(c) for c in args.configs], args.rotation), args.seeds)
    table = run_quality(args.model, configs, args.engine, opts, on_row=write)
    print(to_markdown(table))
    return 0
