#!/usr/bin/env bash
# Installs what is needed (first run only) and runs the whole test suite, in
# one process per core (at most 4; a test file stays in one process, where
# its fixtures are built once; tests/conftest.py splits the cores' threads
# among them and orders the files slowest first, the order they are handed
# out in). Arguments go to pytest: -n 0 runs it in this process alone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/bootstrap.sh"
cd "$root"
exec python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@"
