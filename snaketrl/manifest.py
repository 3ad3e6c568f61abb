"""Per-run manifest: versions, resolved config, data hashes, seed, git commit."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ["torch", "transformers", "trl", "peft", "datasets", "accelerate", "bitsandbytes", "tokenizers",
            "huggingface_hub", "snakemake"]


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def code_hash() -> str:
    """sha256 of what decides a job's computation besides its config and inputs: snaketrl's source files and the
    versions of the packages it runs on. A checkpoint made by other code is not resumed (snaketrl.train.run): its
    steps would not be the ones this code takes."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode())
    root = Path(__file__).parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def numerics(dtype: str) -> dict:
    """What decides a run's rounding besides its seed: the same seed gives bit-identical losses only where all of
    these agree (torch picks its CPU kernels by capability, oneDNN by its ISA limit; threads split reductions)."""
    import os

    import torch

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dnnl_max_cpu_isa": os.environ.get("DNNL_MAX_CPU_ISA"),
            "threads": torch.get_num_threads(), "dtype": dtype}


def write(path, *, resolved: dict, trl_args: dict, inputs: dict, **extra) -> dict:
    """`inputs`: name -> {path, sha256} of every file or directory the run read."""
    from snaketrl.io import write_json

    from snaketrl import __version__

    data = {
        "snaketrl_version": __version__,
        "versions": versions(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "seed": resolved.get("seed"),
        "config": resolved,
        "trl_args": trl_args,
        "inputs": inputs,
        **extra,
    }
    write_json(data, path)
    return data
