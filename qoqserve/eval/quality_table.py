"""The quality table (eval/quality.py's rows) as markdown: one row per
configuration, one column per measured task."""
from __future__ import annotations

# measured besides perplexity, KL and same top (always: they come from one pass)
TASKS = ("greedy", "passkey", "passkey-free", "json")


def _length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def to_markdown(table: dict, names=None, labels=None) -> str:
    """names: the rows to show, in this order, those of them measured (default:
    all); labels: config name -> what the first column says. One column per
    measured task."""
    lengths, measured = table["options"]["lengths"], table["options"].get("tasks", TASKS)
    rows = {r["config"]: r for r in table["rows"]}
    labels = labels or {}
    head = ["configuration", "PPL", "vs FP", "KL mean", "KL p99", "same top"]
    if "greedy" in measured:
        head.append("greedy agree (mean prefix)")
    if "passkey" in measured:
        head += [f"pass key {_length(n)}" for n in lengths]
    if "passkey-free" in measured:
        head += [f"free pass key {_length(n)}" for n in lengths]
    if "json" in measured:
        head.append("JSON keys")
    head.append("quantize s")
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in [rows[n] for n in names if n in rows] if names is not None else table["rows"]:
        label = labels.get(r["config"], r["config"])
        if "not_applicable" in r:
            lines.append(f"| {label} | not applicable: {r['not_applicable']} |" + " |" * (len(head) - 2))
            continue
        is_fp = r["config"] == "FP32"
        cells = [label, f"{r['ppl']:.3f}", "—" if is_fp else f"{100 * r['ppl_delta']:+.1f}%",
                 "—" if is_fp else f"{r['kl_mean']:.4f}", "—" if is_fp else f"{r['kl_p99']:.3f}",
                 "—" if is_fp else f"{100 * r['same_top']:.1f}%"]
        if "greedy" in measured:
            cells.append(f"{100 * r['greedy_agreement']:.0f}% ({100 * r['greedy_prefix']:.0f}%)")
        if "passkey" in measured:
            passkey = {int(k): v for k, v in r["passkey"].items()}  # str keys once through JSON
            cells += [f"{100 * passkey[n]:.0f}%" for n in lengths]
        if "passkey-free" in measured:  # "—": a row kept from a run before the task existed
            free = {int(k): v for k, v in r.get("passkey_free", {}).items()}
            cells += [f"{100 * free[n]:.0f}%" if n in free else "—" for n in lengths]
        if "json" in measured:
            cells.append(f"{100 * r['json_rate']:.0f}%")
        cells.append(f"{r['quantize_seconds']:.0f}" if "quantize_seconds" in r else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
