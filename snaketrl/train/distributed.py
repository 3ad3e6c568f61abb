"""Training in several processes (`distributed:` and `processes:` of a trainer or run): the accelerate config each
mode launches with, how many processes a job runs on how many machines (GPUs: one per GPU of the job's resources;
CPU: the run's `processes`), what each mode allows on that hardware and with bitsandbytes quantization, and the
launch itself: one process group (nccl on GPUs, gloo on CPUs) whose failure ends the whole job with one line.

Pure Python (no torch/transformers/trl, no deepspeed): the Snakefile checks modes at parse time, and the job's
own process only launches.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from snaketrl.errors import ConfigError, TrainingError
from snaketrl.processes import die_with_parent

# One shipped accelerate config per mode, named after it; a job with more than one GPU launches with it.
MODES = ("ddp", "fsdp", "zero2", "zero3")
DEFAULT = "ddp"
# Modes that shard the frozen base weights themselves across GPUs (not just optimizer state and gradients).
SHARDED = frozenset({"fsdp", "zero3"})
DEEPSPEED = frozenset({"zero2", "zero3"})
# Modes with no CPU route in accelerate: `accelerate launch` runs FSDP through its GPU launcher only.
CPU_LESS = frozenset({"fsdp"})
# Relative to the workflow's root: the configs ship with the workflow, wherever it runs from.
CONFIG_DIR = "config/accelerate"


def config_file(mode: str, shipped: Callable[[str], str] | None = None) -> str:
    """The mode's accelerate config (the train job's `accelerate` input): `shipped(rel)` gives the path of
    a file of the workflow (the Snakefile's); without it, the path relative to the clone's root."""
    rel = f"{CONFIG_DIR}/{mode}.yaml"
    return shipped(rel) if shipped else rel


def _where(config: dict, name: str, run: dict, key: str, where: str) -> str:
    """The key path that set `key` of a run: the run's own entry, else its trainer's, else `where`."""
    trainer = run["trainer"]
    if key not in config.get("runs", {}).get(name, {}) and key in config["trainers"][trainer]:
        return f"trainers.{trainer}"
    return where


def check(config: dict, name: str, run: dict, where: str, shipped: Callable[[str], str] | None = None,
          gpus: int = 0) -> None:
    """Parse time (the schema has checked the name): the run's mode has its shipped config, can run on the
    job's hardware (`gpus`: the train rule's GPU count from the profile's or command line's resources, 0 if
    none) and can shard the run's model as quantized. An error names the key that set the mode or the
    process count: the run's, else its trainer's."""
    mode = run.get("distributed", DEFAULT)
    processes = run.get("processes", 1)
    at = _where(config, name, run, "processes", where)
    if gpus and processes > 1 and processes != gpus:
        raise ConfigError(f"config: {at}.processes: {processes} sets a CPU job's process count; the train rule's "
                          f"resources give {gpus} GPU(s), and a GPU job runs one process per GPU: drop processes or "
                          f"set it to {gpus}")
    where = _where(config, name, run, "distributed", where)
    path = config_file(mode, shipped)
    if not Path(path).is_file():
        raise ConfigError(f"config: {where}.distributed: {mode} launches with {path}, which does not exist")
    if not gpus and processes > 1:
        if mode in CPU_LESS:
            raise ConfigError(f"config: {where}.distributed: {mode} needs GPUs (accelerate has no CPU route for "
                              f"FSDP), and run '{name}' trains in {processes} CPU processes ({at}.processes: "
                              f"{processes}; the train rule's resources give no GPU): use ddp, zero2 or zero3 on "
                              f"CPUs, or give train GPUs (set-resources: train: gpu: N)")
        quant = config["models"][run["model"]].get("quantization")
        if quant:
            raise ConfigError(f"config: {at}.processes: run '{name}' trains in {processes} CPU processes (the train "
                              f"rule's resources give no GPU), and models.{run['model']}.quantization: {quant} "
                              f"(bitsandbytes) needs a CUDA GPU; drop the quantization or give train GPUs")
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


def job_machines(resources) -> int:
    """Machines one job spans: one per SLURM task of a CPU job (`tasks`: 2 tasks on one node stand for 2
    machines), else one per node (`nodes`); 1 without either. (The SLURM plugin turns a GPU job's `tasks` into
    --ntasks-per-gpu: GPU jobs count nodes.)"""
    nodes = int(resources.get("nodes", 1) or 1)
    if job_gpus(resources):
        return nodes
    return max(nodes, int(resources.get("tasks", 1) or 1))


def rule_gpus(resources) -> int:
    """The train rule's GPU count at parse time, from what the profile or the command line set for it
    (`--set-resources train:gpu=4`, a profile's `set-resources: train: gres: gpu:a100:4`: Snakemake's
    workflow.resource_settings.overwrite_resources["train"], whose values keep the text as given in `raw`)."""
    raw = {key: getattr(value, "raw", value) for key, value in resources.items()}
    plain = {key: str(value).strip("'\"") if key == "gres" else value for key, value in raw.items()}
    try:
        return job_gpus(plain)
    except (TypeError, ValueError):  # an expression only the job can evaluate: the job checks then
        return 0


@dataclass(frozen=True)
class Plan:
    """How a train job trains: `processes` on each of `machines`, on GPUs (one per GPU) or on CPUs."""

    processes: int
    machines: int = 1
    gpu: bool = False

    @property
    def world(self) -> int:
        return self.processes * self.machines

    @property
    def launched(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        where = f" on each of {self.machines} machines" if self.machines > 1 else ""
        return f"{self.processes} {'GPU' if self.gpu else 'CPU'} process(es){where}, {self.world} in all"


def plan(run: dict, resources) -> Plan:
    """The job's processes: one per GPU of its resources (`gpu` or `gres`), else the run's `processes` on CPUs;
    on each of its `nodes`."""
    gpus = job_gpus(resources)
    if gpus:
        return Plan(gpus, job_machines(resources), gpu=True)
    return Plan(int(run.get("processes", 1)), job_machines(resources))


def launch_command(plan_or_gpus, job_file, config: str, *, machine_rank: int | str = 0,
                   main_ip: str | None = None, port: int | None = None) -> list[str]:
    """`accelerate launch` of snaketrl.train.run.train_run from a JSON job file, in the mode's config file:
    the plan's processes on this machine (its total over every machine is what `--num_processes` takes). The
    counts come from the job's resources and run, not from the file. `port`: the rendezvous port on `main_ip`
    (default 127.0.0.1): every job picks a free one, so that two jobs on one node do not meet."""
    p = plan_or_gpus if isinstance(plan_or_gpus, Plan) else Plan(plan_or_gpus, gpu=True)
    cmd = ["accelerate", "launch", f"--config_file={config}", f"--num_processes={p.world}",
           f"--num_machines={p.machines}"]
    if p.machines > 1:
        cmd += [f"--machine_rank={machine_rank}", f"--main_process_ip={main_ip or '127.0.0.1'}"]
    if port:
        cmd.append(f"--main_process_port={port}")
    return [*cmd, "-m", "snaketrl.train", str(job_file)]


def slurm_command(p: Plan, job_file, config: str, port: int) -> list[str]:
    """A job across machines under SLURM: one `accelerate launch` per node of the job's allocation (a job step
    of one task per node: its SLURM_PROCID is the machine rank), meeting at the first node of the allocation
    (SLURM_JOB_NODELIST), where this job's own process runs."""
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], check=True,
                           capture_output=True, text=True).stdout.split()
    rank = "$SLURM_PROCID"  # each task's own, expanded by its shell; every other word quoted (paths with spaces)
    words = launch_command(p, job_file, config, machine_rank=rank, main_ip=hosts[0], port=port)
    launcher = " ".join(word if word == f"--machine_rank={rank}" else shlex.quote(word) for word in words)
    # --overlap: this job's own step (srun -n1 of the SLURM plugin) already holds the first node's CPUs. One
    # task per node where the allocation has a node per machine (else tasks on one node stand for machines).
    spread = ["--ntasks-per-node=1"] if len(hosts) >= p.machines else []
    return ["srun", "--overlap", f"--nodes={min(len(hosts), p.machines)}", f"--ntasks={p.machines}", *spread,
            "--kill-on-bad-exit=1", "sh", "-c", f"exec {launcher}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_launcher(mode: str, run: str, p: Plan | None = None) -> None:
    """Job start, before any process launches: DeepSpeed modes need the deepspeed package (pinned in
    requirements.txt and envs/train.yaml, but a job may run in an environment of its own); FSDP needs GPUs (parse
    time refuses it on CPUs where the profile's resources show none; a job started with others is told here)."""
    if mode in DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(f"config: run '{run}': distributed: {mode} needs DeepSpeed, which is not installed in this "
                          f"job's environment; run `pip install deepspeed` there, or use distributed: ddp or fsdp")
    if p is not None and not p.gpu and mode in CPU_LESS:
        raise ConfigError(f"config: run '{run}': distributed: {mode} needs GPUs (accelerate has no CPU route for "
                          f"FSDP), and this job has none in its resources: use ddp, zero2 or zero3 on CPUs")


def launch_env(p: Plan, threads: int, mode: str = DEFAULT, environ=None) -> dict:
    """The launcher's environment: the package's home on PYTHONPATH (a conda job's processes start without
    Snakemake's script preamble, which is what put it on sys.path), `threads` per process, and on CPUs in
    ddp mode ACCELERATE_USE_CPU: the shipped ddp.yaml names accelerate's GPU launcher, whose processes on a
    machine without GPUs each train alone on all the data; with it they form one gloo group. DeepSpeed finds
    no GPU by itself and runs on its CPU accelerator over gloo (ACCELERATE_USE_CPU would turn DeepSpeed off).
    A CPU plan's processes see no GPU: the job's resources gave it none, and each process would otherwise take
    the GPU of its local rank (cuda:1 on a one-GPU machine: an invalid device)."""
    environ = dict(os.environ if environ is None else environ)
    home = str(Path(__file__).resolve().parents[2])
    if home not in sys.path:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [home, environ.get("PYTHONPATH")]))
    environ["OMP_NUM_THREADS"] = str(max(1, threads))
    if not p.gpu:
        environ["CUDA_VISIBLE_DEVICES"] = ""
        if mode not in DEEPSPEED:
            environ["ACCELERATE_USE_CPU"] = "true"
    return environ


# torchrun's failure report (torch.distributed.elastic ChildFailedError), one block per failed rank.
_FAILURE = re.compile(r"host\s*:\s*(?P<host>\S+)\s+rank\s*:\s*(?P<rank>\d+)[^\n]*\n\s*exitcode\s*:\s*(?P<code>-?\d+)"
                      r"\s*\(pid:\s*(?P<pid>\d+)\)")
RANK_ERROR = "snaketrl: rank "  # a worker's own one-line error (snaketrl.train.run.main)


def failure_line(run: str, output: str, seconds: float, code: int) -> str:
    """One line for a launched job that failed: the rank that failed first (torchrun's root cause; across
    machines each launcher reports one, and a rank killed by a signal other than the launchers' SIGTERM comes
    before one that only lost its peers), how (the signal, or the exit code with the rank's own error line), and that the rest was stopped."""
    roots = [m.groupdict() for part in output.split("Root Cause")[1:] for m in [_FAILURE.search(part)] if m]
    failures = roots + [m.groupdict() for m in _FAILURE.finditer(output)]
    errors = dict(re.findall(rf"^{re.escape(RANK_ERROR)}(\d+): (.*)$", output, flags=re.M))
    if not failures:
        why = "".join(f"; rank {rank}: {error}" for rank, error in list(errors.items())[:1])
        return f"run '{run}': the launcher exited with code {code} after {seconds:.1f} s{why}"
    # SIGTERM is the launchers' own way of stopping the rest; another signal is what ended a rank.
    first = next((f for f in failures if int(f["code"]) < 0 and -int(f["code"]) != signal.SIGTERM), failures[0])
    status = int(first["code"])
    if status < 0:
        how = f"was killed by {signal.Signals(-status).name}"
    else:
        how = f"exited with code {status}" + (f" ({errors[first['rank']]})" if first["rank"] in errors else "")
    return (f"run '{run}': rank {first['rank']} (pid {first['pid']} on {first['host']}) {how}; the launcher "
            f"stopped the other ranks and the job failed after {seconds:.1f} s")


def run_launch(cmd: list[str], env: dict, run: str, err=None) -> None:
    """Run a launch command to its end, its output into this process's stdout and `err` (default stderr: the
    job's log), ending with this process (die_with_parent). A failure raises TrainingError with
    `failure_line`."""
    err = err or sys.stderr
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=subprocess.PIPE, text=True, errors="replace",
                            preexec_fn=die_with_parent)
    seen: list[str] = []

    def copy():
        for line in proc.stderr:
            seen.append(line)
            err.write(line)
        err.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join()
    if code:
        raise TrainingError(failure_line(run, "".join(seen), time.monotonic() - started, code))
