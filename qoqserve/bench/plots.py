"""PNG plots of benchmark JSON (matplotlib, headless)."""
from __future__ import annotations

import json


def _pyplot():
    # lazy: optional dependency (the bench extra)
    import matplotlib
    matplotlib.use("Agg")
    # lazy: optional dependency (the bench extra)
    import matplotlib.pyplot as plt
    return plt


def plot_throughput_vs_batch(results: list[dict], out: str, title: str = "") -> None:
    """results: rows with precision, batch and decode_tok_per_s or output_tok_per_s
    (`bench decode` / `bench throughput` JSON)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_precision: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        tps = r.get("decode_tok_per_s", r.get("output_tok_per_s"))
        if r.get("batch") and tps:
            by_precision.setdefault(r["precision"], []).append((r["batch"], tps))
    for name, pts in by_precision.items():
        pts.sort()
        ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title or "throughput vs batch")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _load_axis(summary: dict) -> float:
    cfg = summary["config"]
    return cfg["request_rate"] if cfg.get("request_rate") else cfg["concurrency"]


def plot_latency_vs_load(sweeps: dict[str, list[dict]], out: str, title: str = "") -> None:
    """sweeps: label -> `bench serve` summaries at increasing load; TTFT and TPOT
    p50 (solid) and p99 (dashed) against concurrency (or request rate)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    rate = any(s["config"].get("request_rate") for runs in sweeps.values() for s in runs)
    for label, runs in sweeps.items():
        runs = sorted(runs, key=_load_axis)
        x = [_load_axis(s) for s in runs]
        for ax, key in zip(axes, ("ttft_s", "tpot_s")):
            line, = ax.plot(x, [s[key]["p50"] * 1e3 for s in runs], marker="o", label=f"{label} p50")
            ax.plot(x, [s[key]["p99"] * 1e3 for s in runs], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{label} p99")
    for ax, name in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("request rate (req/s)" if rate else "concurrent streams")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs load")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def load_json(path: str):
    with open(path) as f:
        return json.load(f)
