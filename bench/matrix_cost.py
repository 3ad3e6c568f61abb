"""What a models x trainers matrix costs, from the benchmark files of a finished run.

Reads the train rule's benchmark files (Snakemake's per-job wall time and peak memory) and each run's
manifest (its trainer) in a workflow directory, then projects a matrix: jobs submitted and GPU-hours of training.
Usage: python bench/matrix_cost.py [--workdir .] [--models 3] [--trainers sft dpo grpo ppo] [--gpus-per-job 1]
"""

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd

from snaketrl import paths


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
    df = pd.DataFrame(rows)
    return df.groupby("trainer").agg(runs=("run", "count"), mean_s=("s", "mean"), max_rss_mb=("max_rss_mb", "max"))


def project(table: pd.DataFrame, models: int, trainers: list[str], gpus: int) -> dict:
    # PPO needs a reward run per model. Every run: train + plot + length histogram; PPO adds a merge of its
    # reward model and a tokenize job per model; each trainer one dataset (fetch + preprocess); one model
    # build or download per model; the report and `all`.
    runs = {t: models for t in trainers}
    ppo = "ppo" in trainers
    if ppo:
        runs["reward"] = models
    train_jobs = sum(runs.values())
    jobs = 3 * train_jobs + 2 * models * ppo + 2 * len(runs) + models + 2
    seconds = sum(n * table.loc[t, "mean_s"] for t, n in runs.items() if t in table.index)
    return {"runs": train_jobs, "jobs": jobs, "train_hours": seconds / 3600, "gpu_hours": seconds * gpus / 3600,
            "missing": [t for t in runs if t not in table.index]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=".", type=Path, help="where the workflow ran (it holds results/)")
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--trainers", nargs="+", default=["sft", "dpo", "grpo", "ppo"])
    ap.add_argument("--gpus-per-job", type=int, default=1)
    opts = ap.parse_args()
    table = per_trainer(opts.workdir)
    print(table.to_markdown(floatfmt=".1f"))
    p = project(table, opts.models, opts.trainers, opts.gpus_per_job)
    print(f"\n{opts.models} models x {len(opts.trainers)} trainers ({', '.join(opts.trainers)}): {p['runs']} training "
          f"runs, at most {p['jobs']} jobs, {p['train_hours']:.3f} h of training = {p['gpu_hours']:.3f} GPU-hours at "
          f"{opts.gpus_per_job} GPU/job" + (f" (no benchmark for {p['missing']})" if p["missing"] else ""))
    print(f"median job: {statistics.median(table['mean_s']):.1f} s")


if __name__ == "__main__":
    main()
