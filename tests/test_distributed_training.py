"""Training in several processes, for real: jobs launched as snaketrl.train.distributed launches them (accelerate
launch, one gloo group of 2 CPU processes). Every trainer family trains in one launch of 2 processes and is held
against a 1-process run of the same global batch; a rank that dies ends the job in one line within BOUND seconds;
killing the job's process leaves none of its processes behind; the dead rank's run, rerun across two machines
(two launchers on loopback), resumes to the uninterrupted 2-process run's log.

One launch trains all five trainers (`python -m snaketrl.train JOB.json ...`): each launched process imports
torch, transformers and TRL, most of a tiny job's time, once for all of them."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from test_trainers import prepare

from conftest import ROOT
from snaketrl.errors import TrainingError
from snaketrl.io import read_jsonl, write_jsonl
from snaketrl.train import distributed

TRAINERS = ["sft", "dpo", "reward", "grpo", "ppo"]
# 8 rows in global batches of 4 (2 a process): 2 steps an epoch, no short last batch for accelerate to fill
# with repeated rows; a checkpoint every 2 steps; max_length 96 keeps every SFT row.
ARGS = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4}
PER_TRAINER = {"grpo": {"num_generations": 2}, "ppo": {"max_steps": None, "total_episodes": 16}}
# 1 vs 2 processes, same global batch, same rows per step: the losses differ only by the order of fp32 sums
# (gradients all-reduced, each process's loss over its own rows); measured at most 4.8e-7 on losses near 7.
RTOL = 1e-5
BOUND = 60  # seconds from a rank's death to the job's end
CLOCK = ("_runtime", "_per_second", "step_time", "eps")


def _jobs(tmp: Path, tiny_model_dir, reward_dir, trainer: str, name: str) -> dict:
    from snakemake.utils import validate

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(config, str(ROOT / "config/schema.yaml"))
    tmp.mkdir(parents=True, exist_ok=True)
    inputs = prepare(tmp, config, tiny_model_dir, trainer)
    args = inputs["run"]["args"]
    args.update({**ARGS, **PER_TRAINER.get(trainer, {})})
    for key in [k for k, v in args.items() if v is None]:
        del args[key]
    write_jsonl(read_jsonl(inputs["train_file"])[:8], inputs["train_file"])
    inputs["lengths_file"].write_text(json.dumps({"max_length": 96}))
    job = {**inputs, "reward_dir": reward_dir if trainer == "ppo" else None, "threads": 1,
           "out_dir": tmp / name / "out", "checkpoint_dir": tmp / name / "ckpt"}
    return json.loads(json.dumps(job, default=str))


def _token_budget_job(tmp: Path, tiny_model_dir, name: str) -> dict:
    """SFT bounded by max_tokens 700 instead of steps; the histogram's 10 tokens an example (the rows have about
    60) bound it at ceil(700 / (4 x 10)) = 18 steps, and the budget stops it after a few."""
    job = _jobs(tmp, tiny_model_dir, None, "sft", name)
    job["run"]["max_tokens"] = 700
    del job["run"]["args"]["max_steps"]
    Path(job["lengths_file"]).write_text(json.dumps({"max_length": 96, "mean_tokens": 10}))
    return job


def _write(job: dict, path: Path) -> Path:
    path.write_text(json.dumps(job))
    return path


class Lines:
    """A launch's stderr, each line with the time it came."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text):
        self.lines.append((time.monotonic(), text))

    def flush(self):
        pass

    def first(self, needle: str) -> float:
        return next(t for t, line in self.lines if needle in line)

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def launch(job_files, machines: int = 1, env: dict | None = None, mode: str = "ddp", err: Lines | None = None) -> Lines:
    """Launch as the train script does (one launcher); with `machines` 2, one launcher per machine rank on
    loopback, as the SLURM command does on each node. `err` collects the launch's stderr."""
    plan = distributed.Plan(2 // machines, machines)
    config = str(ROOT / distributed.config_file(mode))
    port = distributed.free_port()
    environ = {**distributed.launch_env(plan, 1, mode), **(env or {})}
    err = err if err is not None else Lines()
    if machines == 1:
        cmd = distributed.launch_command(plan, job_files[0], config, port=port)
        distributed.run_launch([*cmd[:-1], *map(str, job_files)], environ, "t-sft", err=err)
        return err
    procs = [subprocess.Popen(distributed.launch_command(plan, job_files[0], config, machine_rank=rank,
                                                         main_ip="127.0.0.1", port=port),
                              env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(machines)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"machine rank {rank}:\n{out[-3000:]}"
        err.lines += [(0.0, line) for line in out.splitlines(keepends=True)]
    return err


def _history(out) -> list[dict]:
    history = json.loads((Path(out) / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in e.items() if not k.endswith(CLOCK)} for e in history]


def _series(out, key) -> list[float]:
    return [e[key] for e in _history(out) if key in e]


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_model_dir, reward_dir):
    """trainer -> (1-process job, 2-process job), both trained; and the launch's stderr."""
    from snaketrl.train.run import train_run

    tmp = tmp_path_factory.mktemp("family")
    jobs = {t: (_jobs(tmp / t, tiny_model_dir, reward_dir, t, "one"), _jobs(tmp / t, tiny_model_dir, reward_dir, t, "two"))
            for t in TRAINERS}
    jobs["sft-tokens"] = tuple(_token_budget_job(tmp / "sft-tokens", tiny_model_dir, n) for n in ("one", "two"))
    for one, _ in jobs.values():
        train_run(**one)
    # A flop budget that one process reaches between its steps 2 and 3: two processes must add their counts.
    flops = json.loads((Path(jobs["sft"][0]["out_dir"]) / "metrics.json").read_text())["cost_by_step"]["flops"]
    budget = _jobs(tmp / "sft-flops", tiny_model_dir, None, "sft", "two")
    budget["run"]["max_flops"] = (flops[1] + flops[2]) / 2
    jobs["sft-flops"] = (None, budget)
    err = launch([_write(two, tmp / f"{t}.json") for t, (_, two) in jobs.items()])
    return jobs, err


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trainer_trains_as_one_group_of_two_processes(family, trainer):
    jobs, err = family
    one, two = (Path(job["out_dir"]) for job in jobs[trainer])
    metrics = json.loads((two / "metrics.json").read_text())
    assert (metrics["processes"], metrics["backend"], metrics["distributed_type"]) == (2, "gloo", "MULTI_CPU")
    assert metrics["global_batch"] == 4 and metrics["global_batch_note"] == (
        "global batch 4 as configured: 2 per process x 2 processes x 1 accumulation steps")
    assert f"rank 0 snaketrl.train INFO t-{trainer}: 2 processes (gloo on CPUs): global batch 4" in err.text()
    # Rank 0 alone wrote the outputs, each whole; a finished run leaves no checkpoint.
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert (two / "adapter" / "adapter_model.safetensors").is_file()
    assert not list(Path(jobs[trainer][1]["checkpoint_dir"]).glob("checkpoint-*"))
    ref = json.loads((one / "metrics.json").read_text())
    if trainer in ("sft", "dpo", "reward"):
        # The same rows each step, split between the processes: the same losses and real tokens. Fewer padded
        # tokens: each process pads its 2 rows to their own longest, not the 4 rows' longest.
        assert _series(two, "loss") == pytest.approx(_series(one, "loss"), rel=RTOL)
        assert len(_series(two, "loss")) == 4
        assert metrics["real_tokens"] == ref["real_tokens"]
        assert metrics["processed_tokens"] < ref["processed_tokens"]
    elif trainer == "grpo":
        # Each process samples from its own RNG: other completions, the same prompts at each step.
        def prompts(out):
            rows = [r for r in read_jsonl(out / "training_samples.jsonl") if r["mode"] == "train"]
            return sorted((r["step"], r["prompt"]) for r in rows)

        assert prompts(two) == prompts(one) and len(prompts(two)) == 4 * 4
    else:  # PPO: every update takes the global batch of episodes, as one process does
        assert _series(two, "episode") == _series(one, "episode") == [4, 8, 12, 16]
        assert all(abs(v) < 10 for v in _series(two, "objective/scores"))


def test_a_token_budget_stops_both_processes_where_one_process_stops(family):
    """Each process counts the tokens of its own rows; the budget is their sum, so both processes stop together,
    at the step one process trained to, with the same tokens and losses."""
    jobs, _ = family
    one, two = (Path(job["out_dir"]) for job in jobs["sft-tokens"])
    metrics = [json.loads((out / "metrics.json").read_text()) for out in (one, two)]
    assert [m.get("processes", 1) for m in metrics] == [1, 2] and [m["max_steps"] for m in metrics] == [18, 18]
    assert metrics[0]["steps"] == metrics[1]["steps"] < 18
    assert 700 <= metrics[0]["real_tokens"] == metrics[1]["real_tokens"] < 700 + 4 * 96
    assert _series(two, "loss") == pytest.approx(_series(one, "loss"), rel=RTOL)


def test_a_flop_budget_stops_two_processes_where_their_summed_flops_reach_it(family):
    """Each process counts its own passes; the budget is the group's, so both stop at the step whose summed
    FLOPs (the report's cost_by_step) reach it, and not a step later as one process's half would."""
    jobs, _ = family
    job = jobs["sft-flops"][1]
    metrics = json.loads((Path(job["out_dir"]) / "metrics.json").read_text())
    flops, reached = metrics["cost_by_step"]["flops"], metrics["max_flops_reached_at"]
    assert metrics["processes"] == 2 and reached == metrics["steps"] == len(flops) < 4
    assert flops[reached - 1] >= job["run"]["max_flops"] > flops[reached - 2]


def test_deepspeed_zero3_trains_on_cpus_as_ddp_does(family, tmp_path):
    """ZeRO-3 shards the weights across the two processes (DeepSpeed's CPU accelerator, gloo); PPO saves its
    gathered policy and value weights (snaketrl.train.ppo), the others through transformers."""
    jobs, _ = family
    zero3 = {t: {**jobs[t][1], "out_dir": str(tmp_path / t / "out"), "checkpoint_dir": str(tmp_path / t / "ckpt")}
             for t in ("sft", "ppo")}
    extensions = tmp_path / "torch_extensions"
    launch([_write(job, tmp_path / f"{t}.json") for t, job in zero3.items()], mode="zero3",
           env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    # DeepSpeed's shared-memory all-reduce, for inference only, is not compiled (snaketrl.imports)
    assert not extensions.exists() or not any(extensions.iterdir())
    for trainer, key in (("sft", "loss"), ("ppo", "loss/value_avg")):
        out, ddp = Path(zero3[trainer]["out_dir"]), jobs[trainer][1]["out_dir"]
        metrics = json.loads((out / "metrics.json").read_text())
        assert (metrics["distributed_type"], metrics["zero_stage"], metrics["backend"]) == ("DEEPSPEED", 3, "gloo")
        # measured: SFT's losses within 5e-7 of DDP's, PPO's value losses within 2e-5 (relative)
        assert _series(out, key) == pytest.approx(_series(ddp, key), rel=1e-4)
        adapter = out / "adapter" / "adapter_model.safetensors"
        assert adapter.is_file() and adapter.stat().st_size > 1000
    assert (tmp_path / "ppo" / "out" / "adapter" / "adapter_config.json").is_file()


def _no_process_of(job_file, timeout: float = 10) -> list:
    """Processes whose command line names `job_file`, after waiting up to `timeout` for them to end."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in psutil.process_iter(["cmdline"]) if str(job_file) in " ".join(p.info["cmdline"] or [])]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_a_dead_rank_ends_the_job_in_one_line_and_a_rerun_across_two_machines_resumes(family, tmp_path):
    jobs, _ = family
    uninterrupted = jobs["sft"][1]
    job = {**uninterrupted, "out_dir": str(tmp_path / "out"), "checkpoint_dir": str(tmp_path / "ckpt")}
    job_file = _write(job, tmp_path / "job.json")
    err = Lines()
    with pytest.raises(TrainingError) as failed:
        launch([job_file], env={"SNAKETRL_KILL_AT": "mid_step:3@1"}, err=err)
    ended = time.monotonic()
    died = err.first("SNAKETRL_KILL_AT=mid_step:3@1: killing this process at mid_step 3")
    print(f"rank 1 killed; the job ended {ended - died:.1f} s later: {failed.value}")
    assert ended - died < BOUND
    assert not _no_process_of(job_file)
    message = str(failed.value)
    assert re.fullmatch(r"run 't-sft': rank 1 \(pid \d+ on \S+\) was killed by SIGKILL; the launcher "
                                    r"stopped the other ranks and the job failed after \d+\.\d s", message), message
    # Checkpoint 2 is whole: both processes' RNG and kept state, sealed by rank 0 after both wrote theirs.
    sealed = json.loads((tmp_path / "ckpt/checkpoint-2/snaketrl_checkpoint.json").read_text())["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth", "snaketrl_state_0.pt", "snaketrl_state_1.pt",
            "adapter_model.safetensors", "optimizer.pt"} <= set(sealed)
    assert not (tmp_path / "out" / "metrics.json").exists()

    err = launch([job_file], machines=2)
    assert "t-sft: the last attempt was cut short: resuming from checkpoint-2 at step 2" in err.text()
    assert _history(job["out_dir"]) == _history(uninterrupted["out_dir"])
    assert json.loads(Path(job["out_dir"], "metrics.json").read_text())["processes"] == 2


def test_killing_the_jobs_process_leaves_none_of_its_processes(family, tmp_path):
    """What a cluster's time limit does (SIGKILL, no handler runs): the launcher and both ranks end with it."""
    jobs, _ = family
    job = {**jobs["sft"][1], "out_dir": str(tmp_path / "out"), "checkpoint_dir": str(tmp_path / "ckpt")}
    job_file = _write(job, tmp_path / "job.json")
    script = (f"from snaketrl.train import distributed as d\n"
              f"p = d.Plan(2)\n"
              f"d.run_launch(d.launch_command(p, {str(job_file)!r}, {str(ROOT / 'config/accelerate/ddp.yaml')!r}, "
              f"port=d.free_port()), d.launch_env(p, 1), 't-sft')\n")
    job_process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
    launcher, ranks = [], []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and time.monotonic() < deadline:  # both ranks importing torch: past die_with_parent
        launcher = psutil.Process(job_process.pid).children()
        ranks = [p for p in (launcher[0].children() if launcher else []) if _maps_torch(p)]
        time.sleep(0.2)
    assert len(ranks) == 2 and all("snaketrl.train" in " ".join(p.cmdline()) for p in ranks), ranks
    assert len(launcher) == 1 and "accelerate" in " ".join(launcher[0].cmdline())
    assert all(rank.is_running() for rank in ranks)  # two processes of one job, alive together
    job_process.send_signal(signal.SIGKILL)
    job_process.wait()
    gone, alive = psutil.wait_procs([*launcher, *ranks], timeout=10)
    assert not alive, alive
    assert not _no_process_of(job_file, timeout=0)


def _maps_torch(process) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
    except OSError:
        return False

