"""Per-run manifest: versions, resolved config, data hashes, seed, git commit."""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ["torch", "transformers", "trl", "peft", "datasets", "accelerate", "bitsandbytes", "tokenizers",
            "huggingface_hub", "snakemake"]


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def write(path, *, resolved: dict, trl_args: dict, files, **extra) -> dict:
    files = [Path(f) for f in files]
    data = {
        "versions": versions(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "seed": resolved.get("seed"),
        "config": resolved,
        "trl_args": trl_args,
        "files": {str(f): sha256(f) for f in files if f.is_file()},
        **extra,
    }
    Path(path).write_text(json.dumps(data, indent=2, default=str))
    return data
