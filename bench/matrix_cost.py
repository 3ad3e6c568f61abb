"""What a models x trainers matrix costs, from the benchmark files of a finished run.

Reads the train rule's benchmark files (Snakemake's per-job wall time and peak memory) and each run's
manifest (its trainer) in a workflow directory, then projects a config's matrix: its training runs (as the
Snakefile resolves them), the jobs a dry run of the workflow lists for it (Snakemake's own count, not a
formula), and GPU-hours of training. --models and --trainers reshape the config's matrix first: N models
(numbered copies of its matrix models' entries beyond its own), those trainers and the runs they start from
(their `policy` and `reward_model`, PPO's reward run).
Usage: python bench/matrix_cost.py [--workdir .] [--configfile config/config.yaml] [--models 3]
       [--trainers sft dpo grpo ppo] [--gpus-per-job 1]
"""

import argparse
import collections
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from dryrun import DRY_RUN, dry_run, with_models  # noqa: E402

from snaketrl import paths  # noqa: E402
from snaketrl.config import resolve_runs, validate  # noqa: E402


def per_trainer(workdir: Path) -> pd.DataFrame:
    rows = []
    for bench in sorted((workdir / paths.benchmark("train", "x")).parent.glob("*.tsv")):
        manifest = workdir / paths.run_file(bench.stem, "manifest.json")
        if not manifest.is_file():
            continue
        trainer = json.loads(manifest.read_text())["config"]["trainer"]
        b = pd.read_csv(bench, sep="\t").iloc[0]
        # The job's own peak where the fork server ran it (snaketrl.forkserver): the benchmark measured its waiter.
        metrics = workdir / paths.run_file(bench.stem, "metrics.json")
        own = json.loads(metrics.read_text()).get("peak_rss_bytes", 0) / 2**20 if metrics.is_file() else 0
        rows.append({"trainer": trainer, "run": bench.stem, "s": float(b["s"]),
                     "max_rss_mb": max(float(b["max_rss"]), own)})
    df = pd.DataFrame(rows, columns=["trainer", "run", "s", "max_rss_mb"])  # none yet: the count alone
    return df.groupby("trainer").agg(runs=("run", "count"), mean_s=("s", "mean"), max_rss_mb=("max_rss_mb", "max"))


def matrix(cfg: dict, models: int | None, trainers: list[str] | None) -> dict:
    """A copy of cfg whose matrix trains `trainers` (and the trainers of the runs they start from: a `policy`
    or `reward_model` that names another matrix run, `{trainer}-{model}`) on `models` models (with_models)."""
    if models is None and trainers is None:
        return cfg
    if not (cfg.get("matrix") or {}).get("models"):
        sys.exit("--models/--trainers: the config has no matrix (matrix.models) to reshape; leave them out to "
                 "count its runs as they are")
    cfg = dict(cfg, matrix=dict(cfg["matrix"]))
    if trainers is not None:
        wanted = list(trainers)
        for trainer in wanted:  # grows while it runs: the runs a run starts from, and theirs
            if trainer not in cfg["trainers"]:
                sys.exit(f"--trainers: '{trainer}' has no entry under trainers; expected some of "
                         f"{sorted(cfg['trainers'])}")
            for key in ("policy", "reward_model"):
                feeder = (cfg["trainers"][trainer].get(key) or "").removesuffix("-{model}")
                if feeder in cfg["trainers"] and feeder not in wanted:
                    wanted.append(feeder)
        cfg["matrix"]["trainers"] = wanted
    return with_models(cfg, models or len(cfg["matrix"]["models"]))


def project(table: pd.DataFrame, cfg: dict, gpus: int, workdir: Path) -> dict:
    """The config's training runs (per trainer), the jobs a dry run from `workdir` lists for it (every job, as
    if nothing were done yet), and its hours of training at the benchmarks' mean job per trainer."""
    checked = copy.deepcopy(cfg)  # validate fills in defaults
    validate(checked, str(ROOT / "config" / "schema.yaml"))
    with contextlib.chdir(workdir):  # relative data files are read from there, as the dry run reads them
        runs = collections.Counter(r["trainer"] for r in resolve_runs(checked, partial(os.path.join, ROOT)).values())
    with tempfile.TemporaryDirectory() as tmp:
        configfile = Path(tmp, "config.yaml")
        configfile.write_text(yaml.safe_dump(cfg, sort_keys=False))
        # --nolock: a dry run beside a run in progress there
        cmd = [*DRY_RUN, "--nolock", "-s", str(ROOT / "Snakefile"), "--configfile", str(configfile)]
        jobs = dry_run(cmd, workdir)[2]
    seconds = sum(n * table.loc[t, "mean_s"] for t, n in runs.items() if t in table.index)
    return {"runs": sum(runs.values()), "per_trainer": dict(runs), "jobs": jobs, "train_hours": seconds / 3600,
            "gpu_hours": seconds * gpus / 3600, "missing": sorted(t for t in runs if t not in table.index)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=".", type=Path, help="where the workflow ran (it holds results/)")
    ap.add_argument("--configfile", default=ROOT / "config" / "config.yaml", type=Path,
                    help="the config to project (default: the offline default)")
    ap.add_argument("--models", type=int, help="the matrix's model count (default: the config's)")
    ap.add_argument("--trainers", nargs="+", help="the matrix's trainers (default: the config's)")
    ap.add_argument("--gpus-per-job", type=int, default=1)
    opts = ap.parse_args()
    table = per_trainer(opts.workdir)
    print(table.to_markdown(floatfmt=".1f"))
    cfg = matrix(yaml.safe_load(opts.configfile.read_text()), opts.models, opts.trainers)
    p = project(table, cfg, opts.gpus_per_job, opts.workdir)
    shape = cfg.get("matrix") or {}
    label = opts.configfile.name + (f", {len(shape['models'])} models x {len(shape['trainers'])} trainers "
                                    f"({', '.join(shape['trainers'])})" if shape.get("models") else "")
    per = ", ".join(f"{n} {t}" for t, n in p["per_trainer"].items())
    print(f"\n{label}: {p['runs']} training runs ({per}), {p['jobs']} jobs, {p['train_hours']:.3f} h of training = "
          f"{p['gpu_hours']:.3f} GPU-hours at {opts.gpus_per_job} GPU/job"
          + (f" (no benchmark for {p['missing']})" if p["missing"] else ""))
    if len(table):
        print(f"median job: {statistics.median(table['mean_s']):.1f} s")


if __name__ == "__main__":
    main()
