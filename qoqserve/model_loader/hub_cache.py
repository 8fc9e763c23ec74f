"""Hugging Face model ids (`Qwen/Qwen3-0.6B`) resolved to the snapshot the
local Hugging Face cache already holds, as vLLM resolves them offline: no
download ever happens here (this machine may have no network), and an id
not in the cache gets a message saying where it looked and how to fetch it.
"""
from __future__ import annotations

import os
import re

from qoqserve.errors import ModelLoadError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(path: str) -> bool:
    return bool(_REPO_ID.match(path)) and not path.startswith((".", "~"))


def local_path(spec: str) -> tuple[str, bool]:
    """(where `spec` is on this machine, whether it named a Hugging Face id):
    the path itself when it exists or is no id, else the id's cached snapshot."""
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path) and looks_like_repo_id(spec):
        return cached_snapshot(spec), True
    return path, False


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps models: $HF_HUB_CACHE, else $HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def cached_snapshot(repo_id: str, revision: str = "main") -> str:
    """The directory of repo_id's cached snapshot at revision (a branch, tag or
    commit): what refs/<revision> names, else the commit of that name."""
    repo = os.path.join(hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    ref = os.path.join(repo, "refs", revision)
    commit = revision
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo, "snapshots", commit)
    if os.path.isdir(snapshot):
        return snapshot
    where = "no such directory" if not os.path.isdir(repo) else f"no snapshot for revision {revision!r}"
    raise ModelLoadError(f"{repo_id!r} is not a local path, and the Hugging Face cache has no copy of it "
                         f"({repo}: {where}); qoqserve downloads nothing: fetch it where there is a network "
                         f"(`huggingface-cli download {repo_id}`) or pass a directory")
