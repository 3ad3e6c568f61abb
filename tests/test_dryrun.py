"""Dry runs at scale: bench/dryrun.py's scaled config and trivial DAG, and the DAG the cheap wildcard
constraints (rules/common.smk `_one_of`) resolve."""

import copy
import importlib.util

import yaml

from conftest import ROOT
from snaketrl import paths
from snaketrl.config import check, validate
from test_workflow import copy_project, snakemake

spec = importlib.util.spec_from_file_location("dryrun", ROOT / "bench" / "dryrun.py")
dryrun = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dryrun)


def job_counts(wd, *args):
    proc = snakemake(wd, *args, "-n", "--forceall", "--quiet", "rules", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    table = out[out.index("job "):out.index("total")]
    return {k: int(v) for k, v in (line.split() for line in table.splitlines()[2:] if line.strip())}


def test_scaled_config_trains_every_default_trainer_on_each_model_copy():
    cfg = dryrun.scaled_config(1000)
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    runs = check(cfg)
    assert len(runs) == 1000 and len(cfg["models"]) == 200
    assert {r["trainer"] for r in runs.values()} == {"sft", "dpo", "reward", "grpo", "ppo"}
    assert cfg["models"]["qwen2-tiny-99"] == cfg["models"]["qwen2-tiny"]
    assert runs["ppo-pythia-tiny-7"]["reward_model"] == "reward-pythia-tiny-7"
    assert cfg["evaluation"]["reward_models"] == ["reward-qwen2-tiny", "reward-pythia-tiny"]


def test_scaled_dry_run_plans_each_runs_jobs_and_the_trivial_dag_as_many(tmp_path):
    wd = copy_project(tmp_path / "wf")
    (wd / "scaled.yaml").write_text(yaml.safe_dump(dryrun.scaled_config(25)))
    counts = job_counts(wd, "--configfile", "scaled.yaml")
    # 5 models x 5 trainers; per model a PPO tokenization and two merges (SFT policy, reward model); 4
    # generating runs + the base evaluated per model; 6 (dataset, trainer) preparations incl. eval pairs;
    # 4 datasets fetched: the runs' 3 and firefly, which only the tiny models' pretraining corpus names.
    assert counts == {"get_dataset": 4, "preprocess": 6, "tiny_model": 5, "pretrain": 5, "length_histogram": 25,
                      "tokenize_prompts": 5, "train": 25, "merge": 10, "plot_run": 25, "evaluate": 25,
                      "collect_evaluation": 1, "report": 1, "all": 1}
    trivial = tmp_path / "trivial"
    trivial.mkdir()
    (trivial / "Snakefile").write_text(dryrun.trivial_snakefile(sum(counts.values())))
    assert sum(job_counts(trivial).values()) == sum(counts.values())
    floor = tmp_path / "floor"
    dryrun.write_snakefile(floor, dryrun.floor_snakefile(sum(counts.values())))
    assert job_counts(floor) == {"one": sum(counts.values()) - 1, "all": 1}
    # The floor's jobs carry what ours do: a log, a conda env, a script, resources by attempt, params.
    proc = snakemake(floor, "-n", "--forceall", "out/3.txt", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "log: logs/3.log" in proc.stdout and "mem_mb=8000" in proc.stdout


def test_a_model_name_holding_a_slash_still_resolves_to_its_own_jobs(tmp_path):
    # '/' defeats the one-segment pattern: the constraint falls back to the exact names.
    wd = copy_project(tmp_path / "wf")
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["models"]["org/tiny"] = copy.deepcopy(cfg["models"]["qwen2-tiny"])
    cfg["runs"] = {"sft-org": {"trainer": "sft", "model": "org/tiny"}}
    (wd / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    target = paths.run_file("sft-org", "trainer_state.json")
    proc = snakemake(wd, "-n", "--forceall", target, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wildcards: model=org/tiny" in proc.stdout
    assert paths.lengths("sft", "tldr", "org/tiny") in proc.stdout
    # get_dataset 4: tldr and the pretraining corpus's other datasets.
    assert job_counts(wd, target) == {"get_dataset": 4, "preprocess": 1, "tiny_model": 1, "pretrain": 1,
                                      "length_histogram": 1, "train": 1}
