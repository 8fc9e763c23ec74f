"""`ruff check` over the package, tests, scripts and the benchmark scripts kept
beside their results under docs/ (rules: pyproject.toml), so a lint error
fails CI like any other test."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "qoqserve", "tests", "scripts", "docs"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
