"""Dry runs at scale: bench/dryrun.py's scaled config and trivial DAG, and the DAG the cheap wildcard
constraints (rules/common.smk `_one_of`) resolve."""

import importlib.util
import re
import subprocess

import yaml

from conftest import ROOT
from snaketrl.config import resolve_runs, validate
from test_workflow import copy_project, env, snakemake

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
    runs = resolve_runs(cfg)
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


def test_engine_patches_plan_the_same_jobs_and_still_catch_a_missing_script(tmp_path):
    """bench/dryrun.py --engine compares like with like: Snakemake without its two per-job costs plans the
    very jobs it plans as released, and a rule whose script is gone still fails the dry run."""
    wd = copy_project(tmp_path / "wf")

    def dry_run(cmd):
        return subprocess.run(cmd, cwd=wd, capture_output=True, text=True, timeout=120, env=env())

    patched = dryrun.patched(dryrun.DRY_RUN, dryrun.SCRIPT_ONCE, dryrun.SIGNATURES_CACHED)
    stock, fast = dry_run(dryrun.DRY_RUN), dry_run(patched)
    assert stock.returncode == fast.returncode == 0, (stock.stderr[-2000:], fast.stderr[-2000:])

    def jobs(out):
        """The planned jobs, without the header, each job's time stamp and id, in an order of their own
        (Snakemake lists them in an order of its sets)."""
        out = re.sub(r"(?m)^\[.*\]$|^    jobid: \d+$", "", out[out.index("\nrule "):])
        return sorted(out.split("\nrule "))

    assert jobs(fast.stdout) == jobs(stock.stdout) and "\nrule train:" in stock.stdout
    (wd / "scripts" / "plot_run.py").unlink()
    stock, fast = dry_run(dryrun.DRY_RUN), dry_run(patched)
    missing = f"No such file or directory: '{wd / 'rules' / '../scripts/plot_run.py'}'"
    assert stock.returncode == fast.returncode == 1
    assert stock.stdout.strip().splitlines()[-1].endswith(missing)
    assert fast.stdout.strip().splitlines()[-1].endswith(missing)


def test_real_model_jobs_take_the_cores_and_tiny_ones_one(tmp_path):
    """config/smollm2.yaml offline: its 50 jobs planned (the wheel is only fetched when download_model runs). A
    real model's train, evaluate and merge jobs take all of --cores (2), models.<name>.threads lowers that (the
    file sets 1: two jobs side by side), and the default's tiny models keep one thread."""
    wd = copy_project(tmp_path / "wf")
    counts = job_counts(wd, "--configfile", "config/smollm2.yaml")
    assert counts == {"download_model": 1, "get_dataset": 4, "preprocess": 6, "length_histogram": 5,
                      "tokenize_prompts": 1, "train": 9, "merge": 4, "plot_run": 9, "evaluate": 9,
                      "collect_evaluation": 1, "report": 1, "all": 1}

    def threads(*args):
        proc = snakemake(wd, "-n", "--forceall", *args, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        jobs = re.findall(r"(?ms)^rule (\w+):\n(.*?)(?=^\[|\Z)", proc.stdout)
        return sorted({(rule, int(m[1]) if (m := re.search(r"threads: (\d+)", body)) else 1) for rule, body in jobs
                       if rule in ("train", "evaluate", "merge", "pretrain")})

    assert threads("--configfile", "config/smollm2.yaml") == [("evaluate", 1), ("merge", 1), ("train", 1)]
    # The runs in a chain (SFT -> GRPO, reward model -> PPO) train first, DPO on its own beside them, evaluation
    # after; what gates training (lengths, tokenized prompts, merges) before any.
    proc = snakemake(wd, "-n", "--forceall", "--configfile", "config/smollm2.yaml", timeout=120)
    jobs = re.findall(r"(?ms)^rule (\w+):\n(.*?)(?=^\[|\Z)", proc.stdout)
    priority = {(rule, m[1] if (m := re.search(r"wildcards: (?:run|evaluated)=(\S+)", body)) else None):
                int(m[1]) if (m := re.search(r"priority: (\d+)", body)) else 0 for rule, body in jobs}
    assert {k: v for k, v in priority.items() if k[0] == "train"} == {
        **{("train", f"{t}-smollm2-seed{s}"): 2 for t in ("sft", "grpo") for s in (1, 2, 3)},
        ("train", "reward-smollm2-seed1"): 2, ("train", "ppo-smollm2-seed1"): 2,
        ("train", "dpo-smollm2-seed1"): 1}
    assert {rule for (rule, _), v in priority.items() if v == 3} == {"length_histogram", "tokenize_prompts", "merge"}
    assert {v for (rule, _), v in priority.items() if rule == "evaluate"} == {0}
    cfg = yaml.safe_load((wd / "config" / "smollm2.yaml").read_text())
    del cfg["models"]["smollm2"]["threads"]
    (wd / "cores.yaml").write_text(yaml.safe_dump(cfg))
    assert threads("--configfile", "cores.yaml") == [("evaluate", 2), ("merge", 2), ("train", 2)]
    assert threads() == [("evaluate", 1), ("merge", 1), ("pretrain", 1), ("train", 1)]


def test_processes_share_the_threads(tmp_path):
    """A CPU run of N processes asks for the model's threads, at least N, and its job shares them out: a tiny
    model's run of 2 processes takes 2 threads (one each, as before), a real model's the --cores (4) it is given,
    2 for each of its 2 processes, not 4 each."""
    wd = copy_project(tmp_path / "wf")

    def train_threads(config, cores):
        (wd / "c.yaml").write_text(yaml.safe_dump(config))
        proc = snakemake(wd, "-n", "--forceall", "--configfile", "c.yaml", "--cores", str(cores), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        jobs = re.findall(r"(?ms)^rule train:\n(.*?)(?=^\[|\Z)", proc.stdout)
        return {re.search(r"wildcards: run=(\S+)", b)[1]: int(re.search(r"threads: (\d+)", b)[1]) for b in jobs
                if "threads:" in b}

    tiny = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    tiny["trainers"]["sft"]["processes"] = 2
    threads = train_threads(tiny, 2)
    assert threads == {"sft-pythia-tiny": 2, "sft-qwen2-tiny": 2}  # the others take 1 (not printed)
    real = yaml.safe_load((wd / "config" / "smollm2.yaml").read_text())
    del real["models"]["smollm2"]["threads"]  # as --cores gives them
    real["trainers"]["sft"]["processes"] = 2
    threads = train_threads(real, 4)
    assert {r: t for r, t in threads.items() if r.startswith("sft-")} == {f"sft-smollm2-seed{s}": 4 for s in (1, 2, 3)}
    real["models"]["smollm2"]["threads"] = 1
    assert {r: t for r, t in train_threads(real, 4).items() if r.startswith("sft-")} == {
        f"sft-smollm2-seed{s}": 2 for s in (1, 2, 3)}
