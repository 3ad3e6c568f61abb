"""Multi-GPU modes (ddp, fsdp, zero2, zero3): what `accelerate launch` makes of each launch command and shipped
config, the process count from a job's resources, the parse-time errors, and the train script's wiring. No GPU
here, and no deepspeed: nothing below launches a process or needs either."""

import json
import os
import re
import runpy
import subprocess
from functools import partial
from types import SimpleNamespace

import pytest
import snakemake_cli
import yaml

from conftest import ROOT
from snaketrl.config import resolve_runs, validate
from snaketrl.errors import ConfigError
from snaketrl.train import distributed

SCHEMA = str(ROOT / "config/schema.yaml")


def launched(mode, gpus=4):
    """accelerate's own reading of our launch command: its parsed arguments and its processes' environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    cmd = distributed.launch_command(gpus, "job.json", distributed.config_file(mode))
    assert cmd[:2] == ["accelerate", "launch"]
    args, defaults, mp_from_file = _validate_launch_command(launch_command_parser().parse_args(cmd[2:]))
    if args.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(
            [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_file else [])])
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)


def test_every_mode_has_a_shipped_config_that_leaves_the_process_count_to_the_job():
    from accelerate.commands.config.config_args import ClusterConfig

    schema = yaml.safe_load(open(SCHEMA))
    assert schema["$defs"]["distributed"]["enum"] == list(distributed.MODES)
    for mode in distributed.MODES:
        cfg = ClusterConfig.from_yaml_file(ROOT / distributed.config_file(mode))  # refuses unknown keys
        assert cfg.num_processes == -1, mode  # not in the file: --num_processes from the job's GPUs
        assert cfg.mixed_precision == "no", mode  # TRL's config turns bf16 on from the hardware
    assert sorted(p.stem for p in (ROOT / distributed.CONFIG_DIR).glob("*.yaml")) == sorted(distributed.MODES)


@pytest.mark.parametrize("mode", distributed.MODES)
def test_launch_command_runs_snaketrl_train_once_per_gpu_in_the_mode(mode):
    args, env = launched(mode, gpus=4)
    assert (args.num_processes, args.num_machines) == (4, 1)
    assert (args.module, args.training_script, args.training_script_args) == (True, "snaketrl.train", ["job.json"])
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    kinds = {"ddp": (True, False, False), "fsdp": (False, True, False), "zero2": (False, False, True),
             "zero3": (False, False, True)}
    assert (args.multi_gpu, args.use_fsdp, args.use_deepspeed) == kinds[mode]


def test_fsdp_config_follows_peft_qlora_rules():
    _, env = launched("fsdp")
    # peft "Use PEFT QLoRA and FSDP": use_orig_params off, RAM-efficient loading (rank 0 reads, others sync).
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "1"
    assert env["FSDP_USE_ORIG_PARAMS"] == "false"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true" and env["FSDP_SYNC_MODULE_STATES"] == "true"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"  # the Trainer swaps in peft's for LoRA
    assert env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"  # a plain adapter for the merge job
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == "false"  # TRL's activation_checkpointing decides


@pytest.mark.parametrize("mode,stage,init", [("zero2", "2", "false"), ("zero3", "3", "true")])
def test_deepspeed_configs_set_the_zero_stage(mode, stage, init):
    _, env = launched(mode)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == stage
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == init  # peft's ZeRO-3 (+QLoRA) guide: on
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"
    assert env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL") == ("true" if mode == "zero3" else None)
    # Batch size and gradient accumulation stay "auto": TRL's config fills them.
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env


@pytest.mark.parametrize("resources,gpus", [
    ({"gpu": 4}, 4), ({"gres": "gpu:a100:4"}, 4), ({"gres": "gpu:2"}, 2), ({"gres": "tmpdisk:100,gpu:h100:8"}, 8),
    ({"gpu": 0, "gres": ""}, 0), ({}, 0), ({"gres": "tmpdisk:100"}, 0), ({"gpu": 1}, 1)])
def test_the_process_count_is_the_jobs_gpu_or_gres_count(resources, gpus):
    assert distributed.job_gpus(resources) == gpus


def _revalidated(config):
    validate(config, SCHEMA)
    return resolve_runs(config)


def test_a_run_inherits_its_trainers_mode_and_may_override_it(config):
    config["trainers"]["sft"]["distributed"] = "fsdp"
    config["runs"]["sft-pythia-tiny"] = {"distributed": "zero3"}
    runs = _revalidated(config)
    assert runs["sft-qwen2-tiny"]["distributed"] == "fsdp"
    assert runs["sft-pythia-tiny"]["distributed"] == "zero3"
    assert runs["dpo-qwen2-tiny"]["distributed"] == "ddp"  # the default: today's data parallel


def test_unknown_mode_is_a_schema_error_naming_the_key(config):
    config["runs"]["sft-qwen2-tiny"] = {"distributed": "deepspeed"}
    with pytest.raises(ConfigError, match=r"^config: runs\.sft-qwen2-tiny\.distributed: 'deepspeed' is not one of "
                                          r"\['ddp', 'fsdp', 'zero2', 'zero3'\]$"):
        validate(config, SCHEMA)


@pytest.mark.parametrize("mode", ["fsdp", "zero3"])
def test_8bit_cannot_be_sharded(config, mode):
    config["models"]["qwen2-tiny"]["quantization"] = "8bit"
    config["trainers"]["sft"]["distributed"] = mode
    with pytest.raises(ConfigError, match=rf"^config: trainers\.sft\.distributed: {mode} shards the base weights, "
                                          r"and models\.qwen2-tiny is loaded in 8-bit .* use quantization: 4bit"):
        _revalidated(config)


def test_the_error_names_the_run_when_the_run_set_the_mode(config):
    config["models"]["qwen2-tiny"]["quantization"] = "8bit"
    config["runs"]["dpo-qwen2-tiny"] = {"distributed": "zero3"}
    with pytest.raises(ConfigError, match=r"^config: runs\.dpo-qwen2-tiny\.distributed: zero3 shards"):
        _revalidated(config)


@pytest.mark.parametrize("quantization,mode", [("8bit", "ddp"), ("8bit", "zero2"), ("4bit", "fsdp"),
                                               ("4bit", "zero3")])
def test_quantization_and_modes_that_work_together(config, quantization, mode):
    config["models"]["qwen2-tiny"]["quantization"] = quantization
    config["trainers"]["sft"]["distributed"] = mode
    assert _revalidated(config)["sft-qwen2-tiny"]["distributed"] == mode


def test_a_missing_accelerate_config_is_a_parse_time_error(config, tmp_path):
    """Looked up where the workflow's files are (the Snakefile's `shipped`), not in the working directory."""
    config["runs"]["sft-qwen2-tiny"] = {"distributed": "fsdp"}
    validate(config, SCHEMA)
    with pytest.raises(ConfigError, match=rf"^config: runs\.sft-qwen2-tiny\.distributed: fsdp launches with "
                                          rf"{tmp_path}/config/accelerate/fsdp\.yaml, which does not exist$"):
        resolve_runs(config, partial(os.path.join, str(tmp_path)))
    assert resolve_runs(config, partial(os.path.join, str(ROOT)))["sft-qwen2-tiny"]["distributed"] == "fsdp"


@pytest.mark.parametrize("bf16,storage,compute", [(True, "bfloat16", "bfloat16"), (False, "float32", "float16")])
def test_4bit_weights_are_stored_in_the_dtype_the_model_loads_in(bf16, storage, compute):
    """peft's FSDP/ZeRO-3 QLoRA rule (bnb_4bit_quant_storage = the model's dtype), by construction."""
    import torch

    from snaketrl.train.loading import quantization_config, weight_dtype

    q = quantization_config("4bit", bf16)
    assert q.load_in_4bit and q.bnb_4bit_quant_storage == getattr(torch, weight_dtype(bf16)) == getattr(torch, storage)
    assert q.bnb_4bit_compute_dtype == getattr(torch, compute)


class Named(dict):
    """Snakemake's input/resources: attributes and .get."""
    __getattr__ = dict.__getitem__


def run_train_script(tmp_path, run, resources, monkeypatch):
    """scripts/train.py with a stand-in `snakemake` object; `accelerate launch` is recorded, not run."""
    launches = []
    monkeypatch.setattr(distributed, "run_launch", lambda cmd, env, run, err=None: launches.append((cmd, env)))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the script turns the Hub offline
    smk = SimpleNamespace(
        rule="train", log=[str(tmp_path / "train.log")], threads=8, resources=Named(resources),
        params=Named(run=run, checkpoints=str(tmp_path / "ckpt")),
        input=Named(model="m", train="t.jsonl", eval="e.jsonl", lengths="l.json",
                    accelerate=distributed.config_file(run["distributed"])),
        output=Named(adapter=str(tmp_path / "run" / "adapter")))
    runpy.run_path(str(ROOT / "scripts/train.py"), init_globals={"snakemake": smk})
    return launches


def test_a_multi_gpu_job_launches_its_runs_mode(config, tmp_path, monkeypatch):
    config["trainers"]["sft"]["distributed"] = "fsdp"
    run = _revalidated(config)["sft-qwen2-tiny"]
    [(cmd, env)] = run_train_script(tmp_path, run, {"gpu": 0, "gres": "gpu:a100:4"}, monkeypatch)
    assert cmd[:5] == ["accelerate", "launch", "--config_file=config/accelerate/fsdp.yaml", "--num_processes=4",
                       "--num_machines=1"]
    assert re.fullmatch(r"--main_process_port=\d+", cmd[5])  # a free one: two jobs on one node never meet
    job = json.loads((tmp_path / "ckpt" / "launch_job.json").read_text())
    assert cmd[-1] == str(tmp_path / "ckpt" / "launch_job.json")
    assert job["run"] == run and job["out_dir"] == str(tmp_path / "run")
    assert job["threads"] == 2 and env["OMP_NUM_THREADS"] == "2"  # the job's 8 threads shared by 4 processes
    assert "ACCELERATE_USE_CPU" not in env  # GPUs: nccl, on the GPUs the job was given
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_deepspeed_missing_fails_at_job_start_in_one_line(config, tmp_path, monkeypatch, capfd):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    config["runs"]["sft-qwen2-tiny"] = {"distributed": "zero3"}
    run = _revalidated(config)["sft-qwen2-tiny"]
    with pytest.raises(SystemExit) as exit_:
        run_train_script(tmp_path, run, {"gpu": 4}, monkeypatch)
    assert exit_.value.code == 1
    assert capfd.readouterr().err == (
        "snaketrl: error in rule train: config: run 'sft-qwen2-tiny': distributed: zero3 needs DeepSpeed, which is "
        "not installed in this job's environment; run `pip install deepspeed` there, or use distributed: ddp or "
        "fsdp\n")
    assert not (tmp_path / "ckpt" / "launch_job.json").exists()  # nothing launched


def test_the_train_job_reads_its_modes_accelerate_config(tmp_path):
    """In the DAG: the mode's file is an input of the train job, so editing it reruns that job."""
    from test_workflow import copy_project, env

    wd = copy_project(tmp_path / "wf")
    cfg = yaml.safe_load((wd / "config/config.yaml").read_text())
    cfg["trainers"]["sft"]["distributed"] = "zero3"
    (wd / "edited.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake_cli.run(["-n", "results/runs/sft-qwen2-tiny/adapter", "results/runs/dpo-qwen2-tiny/adapter",
                              "--configfile", "edited.yaml"], wd, env(), 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inputs = {}
    for block in proc.stdout.split("rule train:")[1:]:
        lines = dict(line.strip().split(": ", 1) for line in block.splitlines()[1:] if ": " in line)
        inputs[lines["wildcards"]] = lines["input"].split(", ")
    # The workflow's own copy, by its absolute path: the same file from any working directory.
    assert str(wd / "config/accelerate/zero3.yaml") in inputs["run=sft-qwen2-tiny"]
    assert str(wd / "config/accelerate/ddp.yaml") in inputs["run=dpo-qwen2-tiny"]


def test_a_cpu_job_launches_the_runs_processes_as_one_gloo_group(config, tmp_path, monkeypatch):
    config["trainers"]["sft"]["processes"] = 2
    run = _revalidated(config)["sft-qwen2-tiny"]
    assert run["processes"] == 2 and "processes" not in _revalidated(config)["dpo-qwen2-tiny"]
    [(cmd, env)] = run_train_script(tmp_path, run, {"gpu": 0}, monkeypatch)
    assert cmd[3:5] == ["--num_processes=2", "--num_machines=1"]
    assert env["ACCELERATE_USE_CPU"] == "true"  # else accelerate's GPU launcher: two runs that know nothing of each other
    # A machine's GPU stays out of processes the job's resources gave none (found on one H100: rank 1 took cuda:1)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert json.loads((tmp_path / "ckpt" / "launch_job.json").read_text())["threads"] == 4  # 8 threads, 2 processes
    config["trainers"]["sft"]["distributed"] = "zero3"
    [(cmd, env)] = run_train_script(tmp_path, _revalidated(config)["sft-qwen2-tiny"], {"gpu": 0}, monkeypatch)
    assert "ACCELERATE_USE_CPU" not in env  # it would turn DeepSpeed off; DeepSpeed finds the CPU itself
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # where no GPU is visible


def test_one_process_trains_in_the_jobs_own_process(config, tmp_path, monkeypatch):
    import snaketrl.train.run as run_module

    trained = []
    monkeypatch.setattr(run_module, "train_run", lambda **job: trained.append(job) or {})
    run = _revalidated(config)["sft-qwen2-tiny"]
    assert run_train_script(tmp_path, run, {"gpu": 1}, monkeypatch) == [] and len(trained) == 1
    assert distributed.plan(run, {}) == distributed.Plan(1)


def test_several_nodes_launch_one_group_through_slurm(config, tmp_path, monkeypatch):
    """One `accelerate launch` per node in a job step of one task per node, meeting at the allocation's first
    node; outside SLURM the job says what it needs."""
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return SimpleNamespace(stdout="node-a\nnode-b\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node-[a-b]")
    plan = distributed.plan({"processes": 1}, {"gres": "gpu:a100:4", "nodes": 2})
    assert plan == distributed.Plan(4, 2, gpu=True) and plan.world == 8
    cmd = distributed.slurm_command(plan, "job.json", "config/accelerate/ddp.yaml", 29511)
    assert calls == [["scontrol", "show", "hostnames", "node-[a-b]"]]
    assert cmd[:7] == ["srun", "--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                       "sh"]
    assert cmd[-1] == ("exec accelerate launch --config_file=config/accelerate/ddp.yaml --num_processes=8 "
                       "--num_machines=2 --machine_rank=$SLURM_PROCID --main_process_ip=node-a "
                       "--main_process_port=29511 -m snaketrl.train job.json")
    # CPUs: a SLURM task per machine; CI's one node holds both (.ci/slurm.sh runs this for real).
    plan = distributed.plan({"processes": 1}, {"tasks": 2, "nodes": 1})
    assert plan == distributed.Plan(1, 2)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: SimpleNamespace(stdout="ci-node\n"))
    cmd = distributed.slurm_command(plan, "job.json", "ddp.yaml", 29511)
    assert cmd[:5] == ["srun", "--overlap", "--nodes=1", "--ntasks=2", "--kill-on-bad-exit=1"]
    assert "--main_process_ip=ci-node" in cmd[-1]
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    run = _revalidated(config)["sft-qwen2-tiny"]
    with pytest.raises(SystemExit):
        run_train_script(tmp_path, run, {"gpu": 2, "nodes": 2}, monkeypatch)
    log = (tmp_path / "train.log").read_text()
    assert ("nodes: 2 in the train rule's resources launches one process group across SLURM nodes, and this job "
            "runs outside SLURM (no SLURM_JOB_NODELIST)") in log


def test_a_multi_node_launch_keeps_paths_with_spaces_whole(tmp_path, monkeypatch):
    """The shell of each SLURM task splits the launch into the words launch_command gives, its rank expanded."""
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: SimpleNamespace(stdout="node-a\nnode-b\n"))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node-[a-b]")
    plan = distributed.Plan(1, 2)
    job, config = tmp_path / "my workflow" / "job's.json", tmp_path / "my workflow" / "ddp $HOME.yaml"
    cmd = distributed.slurm_command(plan, job, str(config), 29511)
    monkeypatch.undo()
    assert cmd[-3:-1] == ["sh", "-c"] and cmd[-1].startswith("exec accelerate launch ")
    echoed = subprocess.run(["sh", "-c", cmd[-1].replace("exec accelerate", "exec printf '%s\\n' accelerate", 1)],
                            env={"SLURM_PROCID": "1", "PATH": os.environ["PATH"]}, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    assert echoed == distributed.launch_command(plan, job, str(config), machine_rank=1, main_ip="node-a", port=29511)
    assert f"--config_file={config}" in echoed and echoed[-1] == str(job)


def test_modes_that_cannot_run_on_cpus_are_refused_at_parse_time(config):
    config["trainers"]["sft"].update(processes=2, distributed="fsdp")
    with pytest.raises(ConfigError, match=r"^config: trainers\.sft\.distributed: fsdp needs GPUs \(accelerate has no "
                                          r"CPU route for FSDP\), and run 'sft-qwen2-tiny' trains in 2 CPU processes "
                                          r"\(trainers\.sft\.processes: 2; the train rule's resources give no GPU\)"):
        _revalidated(config)
    validate(config, SCHEMA)
    assert resolve_runs(config, gpus=2)["sft-qwen2-tiny"]["distributed"] == "fsdp"  # the profile gives train 2 GPUs
    config["trainers"]["sft"]["distributed"] = "zero3"
    assert _revalidated(config)["sft-qwen2-tiny"]["processes"] == 2


def test_a_process_count_that_contradicts_the_gpus_or_the_quantization_is_refused(config):
    config["runs"]["sft-qwen2-tiny"] = {"processes": 2}
    validate(config, SCHEMA)
    with pytest.raises(ConfigError, match=r"^config: runs\.sft-qwen2-tiny\.processes: 2 sets a CPU job's process "
                                          r"count; the train rule's resources give 4 GPU\(s\)"):
        resolve_runs(config, gpus=4)
    config["models"]["qwen2-tiny"]["quantization"] = "4bit"
    with pytest.raises(ConfigError, match=r"^config: runs\.sft-qwen2-tiny\.processes: run 'sft-qwen2-tiny' trains "
                                          r"in 2 CPU processes .* models\.qwen2-tiny\.quantization: 4bit"):
        resolve_runs(config)


@pytest.mark.parametrize("raw,gpus", [({}, 0), ({"gpu": 4}, 4), ({"gres": "'gpu:a100:2'"}, 2),
                                      ({"gres": "gpu:2", "mem_mb": "2000 * attempt"}, 2)])
def test_parse_time_reads_the_gpus_the_profile_gives_train(raw, gpus):
    assert distributed.rule_gpus({k: SimpleNamespace(raw=v) for k, v in raw.items()}) == gpus


@pytest.mark.parametrize("args,split", [
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}, (4, 1, "global batch 8 as configured")),
    ({"per_device_train_batch_size": 4}, (2, 1, "global batch 4 as configured")),
    ({"per_device_train_batch_size": 3}, (3, 1, "global batch 6, not the configured 3: neither"))])
def test_the_configured_batch_stays_the_global_one(args, split):
    from snaketrl.train.args import split_batch

    per_process, batch = split_batch("sft", args, 2)
    got = (per_process["per_device_train_batch_size"], per_process["gradient_accumulation_steps"], batch["note"])
    assert got[:2] == split[:2] and got[2].startswith(split[2])
    assert split_batch("sft", args, 1)[0] is args  # one process: the run's own args, untouched


TORCHRUN = """Failures:
[1]:
  time      : 2026-11-25_10:40:48
  host      : node-a
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 7861)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_10:40:48
  host      : node-a
  rank      : {rank} (local_rank: 1)
  exitcode  : {code} (pid: 7862)  ({name})
"""


def test_a_failed_launch_is_one_line_naming_the_rank_and_how_it_ended():
    killed = TORCHRUN.format(rank=1, code=-9, name="SIGKILL")
    assert distributed.failure_line("r", killed, 3.04, 1) == (
        "run 'r': rank 1 (pid 7862 on node-a) was killed by SIGKILL; the launcher stopped the other ranks and the "
        "job failed after 3.0 s")
    failed = TORCHRUN.format(rank=1, code=1, name="") + "snaketrl: rank 1: config: bad value\n"
    assert distributed.failure_line("r", failed, 2, 1).startswith(
        "run 'r': rank 1 (pid 7862 on node-a) exited with code 1 (config: bad value); the launcher stopped")
    # Across machines: the machine whose rank only lost its peer (exit 1) reports first; the killed one is named.
    other = TORCHRUN.format(rank=0, code=1, name="").replace("node-a", "node-b")
    assert " rank 1 (pid 7862 on node-a) was killed by SIGKILL" in distributed.failure_line("r", other + killed, 2, 1)
    assert distributed.failure_line("r", "", 0.5, 2) == "run 'r': the launcher exited with code 2 after 0.5 s"


def test_kill_points_may_name_a_rank_and_a_signal(monkeypatch):
    from snaketrl.errors import SnaketrlError
    from snaketrl.kill_points import check_kill_env

    monkeypatch.setenv("SNAKETRL_KILL_AT", "mid_step:3@1")
    monkeypatch.setenv("SNAKETRL_KILL_SIGNAL", "SIGSTOP")
    check_kill_env()
    monkeypatch.setenv("SNAKETRL_KILL_AT", "mid_step:3@one")
    with pytest.raises(SnaketrlError, match=r"expected <point>, <point>:<step> or either with @<rank>"):
        check_kill_env()
