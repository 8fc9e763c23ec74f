#!/usr/bin/env bash
# Installs what is needed (first run only) and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/bootstrap.sh"
cd "$root"
exec python -m pytest -q "$@"
