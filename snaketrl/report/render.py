"""The report: one self-contained HTML file (Jinja2, images embedded) comparing every run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from snaketrl.io import read_json, read_jsonl
from snaketrl.report import compute, glance, intervals, leaderboard
from snaketrl.report.figures import data_uri, first_value, last_value, png_bytes, pyplot
from snaketrl.report.format import cell, column, number, plain, pretty_json, table
from snaketrl.report.plots import log_frame
from snaketrl.report.sweeps import sweep_sections, yardstick
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
    # Both are lower bounds of the job's peak: Snakemake samples its process tree (all ranks, but the waiting
    # process alone where the fork server ran the job: snaketrl.forkserver); the job records its own process's.
    peaks = [float(benchmark["max_rss"].iloc[0])] if benchmark is not None and "max_rss" in benchmark else []
    peaks += [metrics["peak_rss_bytes"] / 2**20] if metrics.get("peak_rss_bytes") else []
    if peaks:
        row["peak RSS (MB)"] = max(peaks)
    row["headline (first → last log)"] = ", ".join(
        f"{key} {_fmt(first_value(history, key))} → {_fmt(last_value(history, key))}"
        for key in REGISTRY[entry["trainer"]].headline if last_value(history, key) is not None)
    return row


def _fmt(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "diverged"  # a log from before training stopped on it
    return number(value)


# How the summary's columns read (snaketrl.report.format kinds); the rest are folded away by default.
SUMMARY_KINDS = {"max_length": "int", "truncated": "percent", "dropped (too long)": "int",
                 "expected efficiency": "percent", "token efficiency": "percent", "real tokens/s": "si",
                 "steps": "int", "train loss (last log)": "float", "eval loss": "float", "runtime (s)": "seconds",
                 "samples/s": "float", "peak RSS (MB)": "float", "rows dropped": "int"}
SUMMARY_SHOWN = {"trainer", "model", "dataset", "max_length", "truncated", "token efficiency", "steps",
                 "train loss (last log)", "eval loss", "runtime (s)"}


def frame_table(df: pd.DataFrame, kinds: dict[str, str], shown=None, index: str = "run", cls: str = "") -> dict:
    """A DataFrame (indexed by name) as a report table: columns read as `kinds` says (text otherwise), those
    not in `shown` (when given) folded away by default."""
    columns = [column(index)] + [column(c, kinds.get(c, "text"), secondary=shown is not None and c not in shown)
                                 for c in df.columns]
    rows = [[name, *(None if isinstance(v, float) and math.isnan(v) else v for v in values)]
            for name, values in zip(df.index, df.itertuples(index=False))]
    return table(columns, rows, cls=cls)


def overlay_png(trainer: str, states: dict[str, dict]) -> bytes:
    """The trainer's overlay metric (train and eval) for each of its runs, on one axes, labelled by run."""
    plt = pyplot()

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
    plt = pyplot()

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
    kinds = {"steps": "int", "train loss": "float", "held-out loss": "float", "ln(vocab)": "float",
             "seconds": "seconds"}
    return {"table": frame_table(pd.DataFrame(rows).set_index("model"), kinds, index="model"), "png": data_uri(png)}


def evaluation_section(evaluated: dict[str, dict], groups: dict[str, str], runs: dict[str, dict] | None = None,
                       n_prompts: int = 4) -> dict | None:
    """The yardstick (`evaluated`: eval job -> {metrics, completions} files): the first figure with the
    sentences under it (snaketrl.report.glance), the leaderboard, and completions side by side (prompt |
    base | each run) for a few prompts. `runs`: the resolved runs, for each run's dataset and start model."""
    if not evaluated:
        return None
    runs = runs or {}
    metrics = {job: read_json(f["metrics"]) for job, f in evaluated.items()}
    completions = {job: read_jsonl(f["completions"]) for job, f in evaluated.items()}
    # Per-prompt scores from the files the evaluation database is built from: its intervals recompute from it.
    scores = intervals.prompt_scores([row for rows in completions.values() for row in rows], groups)
    board, best = leaderboard.table(metrics, groups, scores)
    starts = glance.start_jobs(metrics, runs)
    same = glance.unmoved(completions, starts)
    moved = glance.moved_groups(groups, starts, same)
    _, better = leaderboard.frame(metrics, groups)
    col = yardstick({c: better[c] for c in board["mean"].columns})
    datasets = {groups.get(r, r): entry.get("dataset", "") for r, entry in runs.items()}
    # The prompts the yardstick's score was taken over: a reward model judging its own prompts has its own count.
    prompts = max(((m.get("scores") or {}).get(col, {}).get("n") or m.get("n_prompts") or 0
                   for m in metrics.values()), default=0)
    first = None
    if col is not None:
        to_base = glance.base_differences(board, col)
        first = {"png": data_uri(glance.glance_png(board, col, better[col], datasets, moved, to_base)),
                 "sentences": glance.sentences(board, col, better[col], moved, prompts, best, to_base), "metric": col}

    side = []
    first_job = {}  # group -> its first seed's job: the side-by-side table shows one completion per group
    for job in sorted(metrics):
        first_job.setdefault(groups.get(job, job), job)
    for model in sorted({m["model"] for m in metrics.values()}):
        jobs = {g: j for g, j in first_job.items() if g in board["mean"].index and metrics[j]["model"] == model}
        jobs = {g: jobs[g] for g in board["mean"].index if g in jobs}  # bases first, as in the leaderboard
        n = min(n_prompts, *(len(completions[j]) for j in jobs.values()))
        columns = [column("prompt")] + [column(g) for g in jobs]
        rows = [[cell(_text(completions[next(iter(jobs.values()))][i]["prompt"]), i),
                 *(_completion(completions, j, starts.get(j), i, groups) for j in jobs.values())] for i in range(n)]
        side.append({"model": model, "table": table(columns, rows, cls="side")})
    return {"first": first, "leaderboard": leaderboard.to_table(board, best, moved), "side": side,
            "board": board, "best": best, "metric": col, "higher": better.get(col), "moved": moved}


def _completion(completions: dict, job: str, start: str | None, i: int, groups: dict[str, str]) -> dict:
    """A completion as the side-by-side table shows it: its own line breaks, an empty one marked as such, one
    that is its start model's word for word marked too."""
    text = completions[job][i]["completion"]
    if isinstance(text, list):  # conversational: the assistant's messages
        text = "\n".join(m.get("content", "") for m in text)
    if not text.strip():
        return cell("(empty)", "", cls="empty", title="the model generated no text for this prompt")
    if start and completions.get(start) and completions[start][i]["completion"] == completions[job][i]["completion"]:
        return cell(text, text, cls="same", title=f"the same as {groups.get(start, start)}'s")
    return cell(text, text)


def compute_section(runs: dict[str, dict], loaded: dict[str, dict], evaluation: dict | None,
                    groups: dict[str, str]) -> dict | None:
    """Equal compute (snaketrl.report.compute): the cost table, the yardstick against FLOPs and seconds, each
    trainer's curve against FLOPs. None when no run recorded its cost."""
    metrics = {run: data["metrics"] or {} for run, data in loaded.items()}
    if not any(m.get("flops") is not None for m in metrics.values()):
        return None
    costs = compute.chain_cost(runs, metrics)
    yard = None
    if evaluation and evaluation["metric"] is not None:
        png = compute.yardstick_png(evaluation["board"], evaluation["metric"], evaluation["higher"], groups, costs, runs)
        yard = data_uri(png) if png else None
    curves = compute.curves_png(runs, {run: data["state"] for run, data in loaded.items()}, metrics)
    return {"table": compute.cost_table(runs, metrics, costs), "yardstick": yard,
            "metric": (evaluation or {}).get("metric"), "curves": data_uri(curves) if curves else None}


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
            "config": pretty_json(manifest.get("config", {})),
            "manifest": pretty_json({k: v for k, v in manifest.items() if k not in ("config", "trl_args")}),
            "trl_args": pretty_json(manifest.get("trl_args", {})),
            "numerics": manifest.get("numerics"),
        })
    summary = summary_table(runs, loaded)
    sweeps = sweep_sections(runs, {run: data["state"] for run, data in loaded.items()},
                            {job: read_json(f["metrics"]) for job, f in (evaluated or {}).items()})
    overlays = [{"trainer": t, "png": data_uri(overlay_png(t, states))} for t, states in by_trainer.items()]
    evaluation = evaluation_section(evaluated or {}, groups or {}, runs)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
    env.filters.update(num=number, plain=plain)
    html = env.get_template("report.html.j2").render(
        table=frame_table(summary, SUMMARY_KINDS, SUMMARY_SHOWN), sections=sections, overlays=overlays,
        n_runs=len(runs), pretraining=pretraining_section(pretrained or {}), evaluation=evaluation,
        compute=compute_section(runs, loaded, evaluation, groups or {}), db=db_summary(db), sweeps=sweeps,
        models=sorted({e["model"] for e in runs.values()}),
        trainers=sorted({e["trainer"] for e in runs.values()}, key=leaderboard.trainer_rank))
    with atomic(out) as tmp:
        tmp.write_text(html, encoding="utf-8")
    return html
