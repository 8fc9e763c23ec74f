"""`qoqserve` command line: generate, serve, quantize, eval, bench."""
from __future__ import annotations

import argparse
import logging
import sys

from qoqserve.cli import bench, check_kernels, convert, evaluate, generate, quantize, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qoqserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (generate, serve, quantize, evaluate, bench, convert, check_kernels):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"qoqserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
