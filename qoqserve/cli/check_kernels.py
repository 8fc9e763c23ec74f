"""`qoqserve check-kernels`: compile every Triton kernel variant the engine can
launch for real GPU targets, on this machine (no GPU needed), and report
registers, local memory (spills) and shared memory per variant."""
from __future__ import annotations

import json
import os
import sys


def register(sub) -> None:
    p = sub.add_parser("check-kernels", help="AOT-compile every Triton kernel variant for GPU targets "
                                             "(no GPU needed); fails on compile errors, spills in hot "
                                             "kernels or too much shared memory")
    p.add_argument("--target", action="append", default=None,
                   help="sm_90, sm_80, ... (repeatable; default: sm_90 and sm_80)")
    p.add_argument("--quick", action="store_true",
                   help="a representative set (every tile, group size and kernel once) instead of all")
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run_check_kernels_cmd)


def parse_target(text: str) -> int:
    t = text.lower().removeprefix("sm_").removeprefix("sm").rstrip("a")
    if not t.isdigit():
        raise ValueError(f"--target {text!r}: expected sm_80, sm_90, ...")
    return int(t)


def _row(r) -> str:
    # a compiler error's cause is its last line (the first is only the source position)
    cause = [ln for ln in r.error.splitlines() if ln.strip()][-1:] if r.error else r.problems
    status = "ok" if r.ok else "FAIL " + "; ".join(cause)
    return (f"{r.target} {r.kernel:24s} regs {r.regs:4d} local {r.local_bytes:5d} B shared "
            f"{r.shared_bytes:7d} B {r.seconds:5.1f} s  {r.label}  {status}")


def run_check_kernels_cmd(args) -> int:
    # the kernels must be defined as compilable JITFunctions, not interpreted ones
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and \
            "qoqserve.kernels.triton.common" in sys.modules:
        raise ValueError("check-kernels needs TRITON_INTERPRET=0 (the kernels were already "
                         "imported for the interpreter)")
    os.environ["TRITON_INTERPRET"] = "0"
    # lazy: CLI start-up; TRITON_INTERPRET must be set before triton loads
    import triton

    from qoqserve.kernels.triton.aot import as_dicts
    from qoqserve.kernels.triton.variants import check

    targets = [parse_target(t) for t in (args.target or ["sm_90", "sm_80"])]
    print(f"# triton {triton.__version__}, targets {', '.join(f'sm_{t}' for t in targets)}"
          + (", representative set" if args.quick else ", every variant"), flush=True)
    results = check(targets, quick=args.quick, progress=lambda r: print(_row(r), flush=True))
    bad = [r for r in results if not r.ok]
    print(f"# {len(results)} variants compiled, {len(bad)} failed")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"triton": triton.__version__, "targets": targets, "quick": args.quick,
                       "results": as_dicts(results)}, f, indent=2)
    return 1 if bad else 0
