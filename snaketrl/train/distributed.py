"""Multi-GPU modes (`distributed:` of a trainer or run): the accelerate config each launches with, the
process count a job's resources give, and what each mode allows with bitsandbytes quantization.

Pure Python (no torch/transformers/trl, no deepspeed): the Snakefile checks modes at parse time.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

from snaketrl.errors import ConfigError

# One shipped accelerate config per mode, named after it; a job with more than one GPU launches with it.
MODES = ("ddp", "fsdp", "zero2", "zero3")
DEFAULT = "ddp"
# Modes that shard the frozen base weights themselves across GPUs (not just optimizer state and gradients).
SHARDED = frozenset({"fsdp", "zero3"})
DEEPSPEED = frozenset({"zero2", "zero3"})
# Relative to the workflow's root: the configs ship with the workflow, wherever it runs from.
CONFIG_DIR = "config/accelerate"


def config_file(mode: str, shipped: Callable[[str], str] | None = None) -> str:
    """The mode's accelerate config (the train job's `accelerate` input): `shipped(rel)` gives the path of
    a file of the workflow (the Snakefile's); without it, the path relative to the clone's root."""
    rel = f"{CONFIG_DIR}/{mode}.yaml"
    return shipped(rel) if shipped else rel


def check(config: dict, name: str, run: dict, where: str, shipped: Callable[[str], str] | None = None) -> None:
    """Parse time (the schema has checked the name): the run's mode has its shipped config, and can shard
    the run's model as quantized. An error names the key that set the mode: the run's, else its trainer's."""
    mode = run.get("distributed", DEFAULT)
    trainer = run["trainer"]
    if "distributed" not in config.get("runs", {}).get(name, {}) and "distributed" in config["trainers"][trainer]:
        where = f"trainers.{trainer}"
    path = config_file(mode, shipped)
    if not Path(path).is_file():
        raise ConfigError(f"config: {where}.distributed: {mode} launches with {path}, which does not exist")
    # FSDP and ZeRO-3 shard only floating-point tensors: bitsandbytes' 4-bit weights can be stored as floats
    # (bnb_4bit_quant_storage, set by snaketrl.train), its 8-bit weights stay int8 (accelerate issue 1415,
    # peft issue 1566).
    if config["models"][run["model"]].get("quantization") == "8bit" and mode in SHARDED:
        raise ConfigError(f"config: {where}.distributed: {mode} shards the base weights, and models.{run['model']} "
                          f"is loaded in 8-bit (bitsandbytes int8), which cannot be sharded; use quantization: 4bit "
                          f"(QLoRA) with {mode}, or distributed: ddp or zero2 with 8bit")


def job_gpus(resources) -> int:
    """A job's GPU count from its resources: `gpu` (the SLURM plugin's --gpus), else a `gres` of gpu[:type]:N
    (--gres). The SLURM plugin refuses both at once, so at most one is set."""
    gpu = resources.get("gpu", 0) or 0
    if gpu:
        return int(gpu)
    match = re.search(r"(?:^|,)\s*gpu(?::[^:,]+)?:(\d+)", str(resources.get("gres", "") or ""))
    return int(match.group(1)) if match else 0


def launch_command(gpus: int, job_file, config: str) -> list[str]:
    """One process per GPU on this node (`accelerate launch` with the mode's config file), each running
    snaketrl.train.run.train_run from a JSON job file. The process count is the job's GPU count, not the file's."""
    return ["accelerate", "launch", f"--config_file={config}", f"--num_processes={gpus}", "--num_machines=1",
            "-m", "snaketrl.train", str(job_file)]


def check_launcher(mode: str, run: str) -> None:
    """Job start, before any process launches: DeepSpeed modes need the deepspeed package, which this
    project does not install (it compiles CUDA ops against the cluster's toolkit)."""
    if mode in DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(f"config: run '{run}': distributed: {mode} needs DeepSpeed, which is not installed in this "
                          f"job's environment; run `pip install deepspeed` there, or use distributed: ddp or fsdp")
