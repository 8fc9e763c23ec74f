#!/usr/bin/env bash
# Installs what is needed (first run only) and runs the qoqserve CLI from ./.venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/bootstrap.sh"
exec qoqserve "$@"
