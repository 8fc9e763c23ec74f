"""Stage 2 of scripts/gpu_check.sh: n_regs / n_spills / shared memory of every
representative kernel variant, from real launches on the GPU, one JSON line
each (qoqserve.bench.kernel_meta)."""
import json
import sys

from qoqserve.bench.kernel_meta import collect


def main(out_path: str) -> int:
    rows = collect("cuda")
    with open(out_path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if r.get("error") or r.get("n_spills")]
    print(f"# {len(rows)} variants, {len(bad)} with errors or spills", flush=True)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "kernel_meta.jsonl"))
