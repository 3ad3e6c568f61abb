"""The report's first figure and the sentences under it: every trainer × model (× dataset) on the yardstick,
its base model as the reference line, which run leads where, what is within noise, and which runs did not
move from the model they started from.
"""

from __future__ import annotations

import math

from snaketrl.report import leaderboard
from snaketrl.report.figures import png_bytes, pyplot
from snaketrl.report.format import number, spread


def start_jobs(metrics: dict[str, dict], runs: dict[str, dict]) -> dict[str, str]:
    """Eval job of a run -> the eval job of the model it started from: its policy run (GRPO and PPO start
    from the SFT run) where that was evaluated, else its base model (the job's reference)."""
    starts = {}
    for job, m in metrics.items():
        if m.get("trainer") == "base":
            continue
        start = (runs.get(job) or {}).get("policy") or m.get("reference")
        if start in metrics:
            starts[job] = start
    return starts


def unmoved(completions: dict[str, list[dict]], starts: dict[str, str]) -> dict[str, str]:
    """Jobs whose completion of every prompt is their start model's (job -> start): training left what
    it generates unchanged."""
    def texts(job):
        return [(r["prompt_id"], r["completion"]) for r in sorted(completions[job], key=lambda r: r["prompt_id"])]

    return {job: start for job, start in starts.items()
            if completions.get(job) and completions.get(start) and texts(job) == texts(start)}


def moved_groups(groups: dict[str, str], starts: dict[str, str], same: dict[str, str]) -> dict[str, str | None]:
    """Group -> None if it moved from its start model, else that start's group (every seed unmoved). Groups
    whose start model was not evaluated are left out: nothing to compare with."""
    members: dict[str, list[str]] = {}
    for job in starts:
        members.setdefault(groups.get(job, job), []).append(job)
    return {group: groups.get(same[jobs[0]], same[jobs[0]]) if all(j in same for j in jobs) else None
            for group, jobs in members.items()}


def row_labels(board: dict, datasets: dict[str, str]) -> dict[str, str]:
    """Each run group's row in the figure: "trainer · dataset", shared by that trainer's models; a group that
    would share its row with another of its model (a sweep's combinations, runs of one trainer) gets its own,
    named by the group."""
    info = board["info"]
    groups = [g for g in info.index if info.loc[g, "trainer"] != "base"]
    labels = {g: f"{info.loc[g, 'trainer']} · {datasets[g]}" if datasets.get(g) else info.loc[g, "trainer"]
              for g in groups}
    cells = [(labels[g], info.loc[g, "model"]) for g in groups]
    return {g: g if cells.count((labels[g], info.loc[g, "model"])) > 1 else labels[g] for g in groups}


def glance_png(board: dict, col: str, higher: bool | None, datasets: dict[str, str],
               moved: dict[str, str | None]) -> bytes:
    """One row per trainer (and dataset), one marker per model: the yardstick's mean with its error bar;
    hollow where the run did not move from its start model, "diverged" where it has no value; each base
    model a dashed line in its model's colour."""
    plt = pyplot()

    mean, info = board["mean"], board["info"]
    models = list(dict.fromkeys(info["model"]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    labels = row_labels(board, datasets)
    rows = sorted(set(labels.values()), key=lambda label: min(
        (leaderboard.trainer_rank(info.loc[g, "trainer"]), label) for g in labels if labels[g] == label))
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.9))
    offset = {m: (i - (len(models) - 1) / 2) * 0.18 for i, m in enumerate(models)}
    finite = [v for v in mean[col] if v == v]
    left = min(finite) if finite else 0
    for group in mean.index:
        model, trainer = info.loc[group, "model"], info.loc[group, "trainer"]
        value = mean.loc[group, col]
        if trainer == "base":
            if value == value:
                ax.axvline(value, color=colors[model], linestyle="--", linewidth=1.2, label=f"{group} (start)")
            continue
        y = rows.index(labels[group]) + offset[model]
        if info.loc[group, "diverged"] or value != value:
            ax.text(left, y, "diverged" if info.loc[group, "diverged"] else "no value", color=colors[model],
                    va="center", fontsize=8, fontweight="bold")
            continue
        hollow = bool(moved.get(group))
        bar = board["noise"].loc[group, col]
        ax.errorbar(value, y, xerr=bar if bar == bar else None, fmt="o", markersize=7, capsize=3, color=colors[model],
                    markerfacecolor="white" if hollow else colors[model], markeredgewidth=1.5)
    for model in models:  # one legend entry per model, whatever was drawn first
        ax.plot([], [], "o", color=colors[model], label=model)
    if any(moved.values()):
        ax.plot([], [], "o", color="grey", markerfacecolor="white", label="did not move from its start")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    direction = {True: "higher is better", False: "lower is better"}.get(higher, "")
    ax.set_xlabel(f"{col}" + (f" ({direction})" if direction else ""))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    return png_bytes(fig)


def sentences(board: dict, col: str, higher: bool | None, moved: dict[str, str | None], n_prompts: int | None,
              best: dict) -> list[str]:
    """What the figure shows, from the data: the best run per model against its base and runner-up (a lead
    within noise: within the seed spread, or with one seed within the error bars), which runs did not move,
    which diverged."""
    mean, std, info = board["mean"], board["std"], board["info"]
    k = leaderboard.kind(col)
    d = 1 if k == "percent" else None
    if k != "percent":
        from snaketrl.report.format import decimals_for

        d = decimals_for(mean[col].dropna().tolist())

    def show(group):
        text = number(mean.loc[group, col], k, d)
        sd = std.loc[group, col]
        return text + (f" ± {spread(sd, k, d)}" if sd == sd else "")

    seeds = int(info["seeds"].max()) if len(info) else 1
    out = [f"Yardstick: {col}" + {True: ", higher is better", False: ", lower is better"}.get(higher, "")
           + (f"; each value the mean over {seeds} seeds ± their std." if seeds > 1 else
              f"; one seed per run (bars: the standard error of the mean over {n_prompts} prompts).")]
    if higher is not None:
        per_model = []
        for model in dict.fromkeys(info["model"]):
            groups = [g for g in mean.index if info.loc[g, "model"] == model and mean.loc[g, col] == mean.loc[g, col]]
            runs = sorted((g for g in groups if info.loc[g, "trainer"] != "base"),
                          key=lambda g: mean.loc[g, col], reverse=higher)
            base = next((g for g in groups if info.loc[g, "trainer"] == "base"), None)
            if not runs:
                continue
            top = runs[0]
            ties = [g for g in runs[1:] if leaderboard.tied(mean.loc[g, col], mean.loc[top, col])]
            if ties:
                text = f"{model}: no run leads; " + ", ".join([top, *ties]) + f" tie at {show(top)}"
            else:
                text = f"{model}: best is {top} ({show(top)})"
                if len(runs) > 1:
                    second = runs[1]
                    lead = abs(mean.loc[top, col] - mean.loc[second, col])
                    shown = lead * (100 if k == "percent" else 1)  # percentage points for a share
                    places = max(d, math.ceil(-math.log10(shown))) if shown else d
                    text += f", {number(shown, 'float', places)}{' points' if k == 'percent' else ''} ahead of {second}"
                    noise = board["noise"].loc[top, col] + board["noise"].loc[second, col]
                    where = "the seed spread" if seeds > 1 else "the error bars"
                    if noise == noise:
                        text += f" (within {where})" if lead < noise else f" (more than {where})"
            if base is not None:
                delta = mean.loc[top, col] - mean.loc[base, col]
                above = (delta > 0) == higher
                text += ("; it equals its base" if leaderboard.tied(mean.loc[top, col], mean.loc[base, col]) else
                         f"; {'better' if above else 'worse'} than its base {base} ({show(base)})")
            per_model.append(text)
        out.append("Best per model on the yardstick: " + "; ".join(per_model) + "." if per_model else
                   "No run has a value on the yardstick.")
    close = [f"{c}: {b['group']} ≈ {b['runner_up']}" for c, b in best.items() if b["within_spread"]]
    noise = "the seed spread" if seeds > 1 else "the standard error over the prompts"
    if close:
        out.append(f"Leads within {noise} (≈ in the leaderboard): " + "; ".join(close) + ".")
    elif best:
        out.append(f"Where a run leads a leaderboard column (★), it leads by more than {noise}.")
    if seeds == 1:
        out.append("A run's variation across seeds is not known with one seed: set seeds: [1, 2, 3] to measure it.")
    same = {g: s for g, s in moved.items() if s}
    if same:
        out.append(f"Did not move from their start model (the same completion for every prompt): "
                   + ", ".join(f"{g} (= {s})" for g, s in same.items()) + ".")
    elif moved:
        out.append("Every run's completions differ from its start model's.")
    diverged = [g for g in mean.index if info.loc[g, "diverged"]]
    if diverged:
        out.append("Diverged, so not ranked: " + ", ".join(diverged) + ".")
    return out
