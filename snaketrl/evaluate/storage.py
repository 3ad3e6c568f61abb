"""One SQLite database of every eval job's completions and metrics and the training-time samples.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from pathlib import Path

from snaketrl.io import atomic, read_jsonl

COMPLETION_COLUMNS = ["run", "model", "trainer", "seed", "prompt_id", "prompt", "completion", "n_tokens"]


SAMPLE_COLUMNS = ["run", "step", "prompt", "completion", "reward"]

# Each eval job and its group (the run without its seed): the report folds a group's seeds into one row.
GROUP_COLUMNS = ["run", "run_group"]


def flatten(obj: dict, prefix: str = "") -> dict:
    """Nested metrics as SQL-friendly column names: {"scores": {"fn_x": {"mean": 1}}} -> scores_fn_x_mean."""
    out = {}
    for key, value in obj.items():
        col = re.sub(r"\W+", "_", f"{prefix}{key}").strip("_")
        if isinstance(value, dict):
            out.update(flatten(value, col + "_"))
        else:
            out[col] = value
    return out


def _sql_value(value):
    if value is None or isinstance(value, (int, float, str, bytes)):
        return None if isinstance(value, float) and math.isnan(value) else value
    return json.dumps(value, ensure_ascii=False)


def _create(db, table: str, columns: list[str], rows: list[dict]) -> None:
    db.execute(f'CREATE TABLE "{table}" ({", ".join(f"{chr(34)}{c}{chr(34)}" for c in columns)})')
    marks = ", ".join("?" * len(columns))
    db.executemany(f'INSERT INTO "{table}" VALUES ({marks})', [[_sql_value(r.get(c)) for c in columns] for r in rows])


def collect(jsonl_files, db_path, *, metrics_files=None, samples_files=(), groups: dict | None = None) -> dict:
    """One SQLite database from every eval job: `completions` (one row per run x prompt: run, model,
    trainer, seed, prompt_id, prompt, completion, n_tokens, then one column per score), `metrics` (one row
    per run, nested metrics flattened), `training_samples` (run, step, prompt, completion, reward, from
    GRPO's/PPO's training logs: snaketrl.train.training_samples), `run_groups` (run, run_group: `groups`,
    eval job -> its group; a job not named is its own). The completions' per-prompt scores are what the
    report's intervals are computed from (snaketrl.report.intervals). `metrics_files` default to the
    metrics.json beside each completions file. Written under a temporary name, then renamed. Returns row
    counts."""

    jsonl_files = [Path(p) for p in jsonl_files]
    metrics_files = [Path(p) for p in metrics_files] if metrics_files is not None else [
        p.with_name("metrics.json") for p in jsonl_files]
    completions = [row for path in jsonl_files for row in read_jsonl(path)]
    metrics = [flatten(json.loads(Path(p).read_text())) for p in metrics_files if Path(p).is_file()]
    samples = [row for path in samples_files for row in read_jsonl(path)]
    extra = sorted({k for r in completions for k in r} - set(COMPLETION_COLUMNS))
    metric_cols = list(dict.fromkeys(["run", "model", "trainer", "seed", *(k for m in metrics for k in m)]))
    sample_cols = list(dict.fromkeys([*SAMPLE_COLUMNS, *(k for r in samples for k in r)]))
    jobs = dict.fromkeys(r["run"] for r in completions)
    run_groups = [{"run": job, "run_group": (groups or {}).get(job, job)} for job in jobs]
    with atomic(db_path) as tmp:
        db = sqlite3.connect(tmp)
        try:
            _create(db, "completions", COMPLETION_COLUMNS + extra, completions)
            _create(db, "metrics", metric_cols, metrics)
            _create(db, "training_samples", sample_cols, samples)
            _create(db, "run_groups", GROUP_COLUMNS, run_groups)
            db.execute("CREATE INDEX completions_run ON completions (run, prompt_id)")
            db.commit()
        finally:
            db.close()
    return {"completions": len(completions), "metrics": len(metrics), "training_samples": len(samples),
            "run_groups": len(run_groups)}
