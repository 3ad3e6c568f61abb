"""The report: one self-contained HTML file (Jinja2, images embedded) comparing every run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from snaketrl.io import read_json, read_jsonl
from snaketrl.report import leaderboard
from snaketrl.report.figures import data_uri, first_value, last_value, png_bytes
from snaketrl.report.plots import log_frame
from snaketrl.report.sweeps import sweep_sections
from snaketrl.trainers import REGISTRY

TEMPLATE_DIR = Path(__file__).parent / "templates"


def used_batching(lengths: dict, metrics: dict) -> dict:
    """The batching a run trained with: the length stage's choice for the device it ran on (metrics.json names
    the device, and whether row groups ran: they are off under FSDP/ZeRO-3 and Liger's fused losses)."""
    device = metrics.get("device", "cpu")
    choice = dict(lengths.get("batching_by_device", {}).get(device) or lengths.get("batching", {}))
    if choice:
        choice["device"] = device
        choice["split_rows"] = metrics.get("row_groups", choice.get("split_rows"))
    return choice


def summarize(run: str, entry: dict, state: dict, lengths: dict, benchmark: pd.DataFrame | None,
              metrics: dict | None = None) -> dict:
    history, metrics = state["log_history"], metrics or {}
    batching = used_batching(lengths, metrics)
    device, split = batching.get("device", "cpu"), batching.get("split_rows")
    row = {
        "run": run, "trainer": entry["trainer"], "model": entry["model"], "dataset": entry["dataset"],
        "max_length": lengths["max_length"], "truncated": lengths["share_truncated"],
        "dropped (too long)": lengths.get("dropped", 0),
        "device": device,
        "batching": batching.get("strategy", "") + (", 2 row groups" if split else "") or None,
        "expected efficiency": batching.get("expected_efficiency"),
        "token efficiency": metrics.get("token_efficiency"),
        "real tokens/s": metrics.get("real_tokens_per_second"),
        "steps": state["global_step"],
        "train loss (last log)": last_value([h for h in history if "train_runtime" not in h], "loss"),
        "eval loss": last_value(history, "eval_loss"),
        "runtime (s)": last_value(history, "train_runtime"),
        "samples/s": last_value(history, "train_samples_per_second"),
    }
    if benchmark is not None and "max_rss" in benchmark:
        row["peak RSS (MB)"] = float(benchmark["max_rss"].iloc[0])
    row["headline (first → last log)"] = ", ".join(
        f"{key} {_fmt(first_value(history, key))} → {_fmt(last_value(history, key))}"
        for key in REGISTRY[entry["trainer"]].headline if last_value(history, key) is not None)
    return row


def _fmt(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "diverged"  # a log from before training stopped on it
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def overlay_png(trainer: str, states: dict[str, dict]) -> bytes:
    """The trainer's overlay metric (train and eval) for each of its runs, on one axes, labelled by run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = REGISTRY[trainer].overlay
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run, state in states.items():
        df = log_frame(state)
        for col, style in ((key, "-"), (f"eval_{key}", "--")):
            if col in df:
                series = df[col].dropna()
                ax.plot(series.index, series.values, style, marker=".", label=f"{run} {col}")
    ax.set_title(f"{trainer}: {key} across runs", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    return png_bytes(fig)


def load_runs(files: dict[str, dict]) -> dict[str, dict]:
    """Each run's files (the report rule's inputs, by run: states, lengths, benchmarks, manifests,
    summaries, curves, histograms), read once."""
    loaded = {}
    for run, f in files.items():
        bench = Path(f["benchmarks"])
        loaded[run] = {
            "state": read_json(f["states"]),
            "lengths": read_json(f["lengths"]),
            "bench": pd.read_csv(bench, sep="\t") if bench.is_file() else None,
            "manifest": read_json(f["manifests"]),
            "metrics": read_json(f["metrics"]),
            "data": read_json(f["summaries"]),
            "curves": f["curves"],
            "histogram": f["histograms"],
        }
    return loaded


def summary_table(runs: dict[str, dict], loaded: dict[str, dict]) -> pd.DataFrame:
    rows = []
    for run, entry in runs.items():
        row = summarize(run, entry, loaded[run]["state"], loaded[run]["lengths"], loaded[run]["bench"],
                        loaded[run]["metrics"])
        data = loaded[run]["data"]  # preprocess summary: malformed lines (fetch) and invalid rows per split
        row["rows dropped"] = data.get("fetch", {}).get("count", 0) + sum(
            data[split]["dropped"] for split in ("train", "eval") if split in data)
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def pretraining_section(pretrained: dict[str, dict]) -> dict | None:
    """The tiny bases' pretraining (`pretrained`: model -> {state, metrics} files): a table and one figure."""
    if not pretrained:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for model, f in pretrained.items():
        metrics, df = read_json(f["metrics"]), log_frame(read_json(f["state"]))
        rows.append({"model": model, "steps": metrics["steps"], "train loss": metrics["train_loss"],
                     "held-out loss": metrics["eval_loss"], "ln(vocab)": metrics["ln_vocab"],
                     "seconds": metrics["train_runtime"], "sample": metrics.get("sample", "")})
        for col, style in (("loss", "-"), ("eval_loss", "--")):
            if col in df:
                series = df[col].dropna()
                ax.plot(series.index, series.values, style, label=f"{model} {col}")
    ax.set_xlabel("step")
    ax.set_title("pretraining loss", fontsize=10)
    ax.legend(fontsize=7)
    png = png_bytes(fig)
    table = pd.DataFrame(rows).set_index("model")
    return {"table": table.to_html(float_format=lambda v: f"{v:.4g}", classes="summary"),
            "png": data_uri(png)}


def evaluation_section(evaluated: dict[str, dict], groups: dict[str, str], n_prompts: int = 4) -> dict | None:
    """The yardstick (`evaluated`: eval job -> {metrics, completions} files): the leaderboard, mean reward per
    run with error bars, and completions side by side (prompt | base | each run) for a few prompts."""
    if not evaluated:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = {job: read_json(f["metrics"]) for job, f in evaluated.items()}
    board, best = leaderboard.table(metrics, groups)
    scores = [c for c in board["mean"].columns if c.startswith("rm_") and not c.endswith(" win")]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(board["mean"])), 3.5))
    width = 0.8 / max(1, len(scores))
    for i, score in enumerate(scores):
        # Spread over seeds where there are several, else over the prompts of the one job.
        prompt_std = {groups.get(j, j): m["scores"][score]["std"] for j, m in metrics.items() if score in m.get("scores", {})}
        err = [board["std"].loc[g, score] if board["info"].loc[g, "seeds"] > 1 else prompt_std.get(g, 0)
               for g in board["mean"].index]
        ax.bar([x + i * width for x in range(len(board["mean"]))], board["mean"][score], width, yerr=err, capsize=2,
               label=score)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(board["mean"]))], board["mean"].index, rotation=45,
                  ha="right", fontsize=7)
    ax.set_title("mean reward-model score per run (error bars: seeds, or prompts for one seed)", fontsize=9)
    ax.legend(fontsize=7)
    png = png_bytes(fig)

    side = []
    completions = {job: read_jsonl(f["completions"]) for job, f in evaluated.items()}
    first_job = {}  # group -> its first seed's job: the side-by-side table shows one completion per group
    for job in sorted(metrics):
        first_job.setdefault(groups.get(job, job), job)
    for model in sorted({m["model"] for m in metrics.values()}):
        jobs = {g: j for g, j in first_job.items() if g in board["mean"].index and metrics[j]["model"] == model}
        jobs = {g: jobs[g] for g in board["mean"].index if g in jobs}  # bases first, as in the leaderboard
        n = min(n_prompts, *(len(completions[j]) for j in jobs.values()))
        rows = [{"prompt": _text(completions[next(iter(jobs.values()))][i]["prompt"]),
                 **{g: completions[j][i]["completion"] for g, j in jobs.items()}} for i in range(n)]
        side.append({"model": model, "table": pd.DataFrame(rows).to_html(index=False, classes="summary side")})
    return {"leaderboard": leaderboard.to_html(board, best), "png": data_uri(png), "side": side}


def db_summary(db) -> dict | None:
    """Where the completions are kept, and how many rows each table holds."""
    if not db:
        return None
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        tables = [name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        counts = {t: con.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}
    return {"path": str(db), "counts": counts}


def _text(prompt) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return prompt


def render(*, runs: dict[str, dict], files: dict[str, dict], out, pretrained: dict[str, dict] | None = None,
           evaluated: dict[str, dict] | None = None, groups: dict[str, str] | None = None, db=None) -> str:
    import jinja2

    from snaketrl.io import atomic

    loaded = load_runs(files)
    sections, by_trainer = [], {}
    for run, entry in runs.items():
        data = loaded[run]
        by_trainer.setdefault(entry["trainer"], {})[run] = data["state"]
        manifest = data["manifest"]
        sections.append({
            "run": run, "entry": entry, "lengths": data["lengths"], "metrics": data["metrics"],
            "batching": used_batching(data["lengths"], data["metrics"] or {}),
            "curves": data_uri(data["curves"]),
            "histogram": data_uri(data["histogram"]),
            "config": json.dumps(manifest.get("config", {}), indent=2),
            "manifest": json.dumps({k: v for k, v in manifest.items() if k not in ("config", "trl_args")}, indent=2),
            "trl_args": json.dumps(manifest.get("trl_args", {}), indent=2),
        })
    table = summary_table(runs, loaded)
    sweeps = sweep_sections(runs, {run: data["state"] for run, data in loaded.items()},
                            {job: read_json(f["metrics"]) for job, f in (evaluated or {}).items()})
    overlays = [{"trainer": t, "png": data_uri(overlay_png(t, states))} for t, states in by_trainer.items()]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
    html = env.get_template("report.html.j2").render(
        table=table.to_html(float_format=lambda v: f"{v:.4g}", na_rep="–", classes="summary"),
        sections=sections, overlays=overlays, n_runs=len(runs), pretraining=pretraining_section(pretrained or {}),
        evaluation=evaluation_section(evaluated or {}, groups or {}), db=db_summary(db), sweeps=sweeps)
    with atomic(out) as tmp:
        tmp.write_text(html, encoding="utf-8")
    return html
