"""The report's first figure and the sentences under it: every trainer × model (× dataset) on the yardstick,
its base model as the reference line, which run leads where, what is within noise, and which runs did not
move from the model they started from.
"""

from __future__ import annotations

import math

from snaketrl.report import intervals, leaderboard
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


def base_of(board: dict, group: str) -> str | None:
    """The untrained base of a group's model: the reference its runs are read against."""
    info = board["info"]
    return next((g for g in info.index if info.loc[g, "trainer"] == "base"
                 and info.loc[g, "model"] == info.loc[group, "model"]), None)


def base_differences(board: dict, col: str) -> dict[str, intervals.Difference]:
    """Run group -> its paired difference to its base on `col` (snaketrl.report.intervals), where both have
    per-prompt values."""
    info, out = board["info"], {}
    for group in info.index:
        base = base_of(board, group) if info.loc[group, "trainer"] != "base" else None
        d = intervals.compare(board["scores"], group, base, col) if base else None
        if d is not None:
            out[group] = d
    return out


def glance_png(board: dict, col: str, higher: bool | None, datasets: dict[str, str],
               moved: dict[str, str | None], to_base: dict[str, intervals.Difference] | None = None) -> bytes:
    """One row per trainer (and dataset), one marker per model: the yardstick's mean, its bar the 95 % interval
    of its paired difference to its base (`to_base`: base_differences) drawn around it, so a bar that crosses
    the base's line is no difference from it; hollow where the run did not move from its start model,
    "diverged" where it has no value; each base model a dashed line in its model's colour."""
    plt = pyplot()

    mean, info, to_base = board["mean"], board["info"], to_base or {}
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
        d = to_base.get(group)
        bar = [[d.difference - d.low], [d.high - d.difference]] if d else None
        ax.errorbar(value, y, xerr=bar, fmt="o", markersize=7, capsize=3, color=colors[model],
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
              best: dict, to_base: dict[str, intervals.Difference] | None = None) -> list[str]:
    """What the figure shows, from the data: the best run per model against its runner-up and its base, each
    with the 95 % interval of the paired difference (a lead only where it excludes zero; for a tie, what would
    settle it), the leaderboard's unsettled leads, which runs did not move, which diverged."""
    mean, std, info, to_base = board["mean"], board["std"], board["info"], to_base or {}
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
    fewest = int(info.loc[info["trainer"] != "base", "seeds"].min()) if (info["trainer"] != "base").any() else seeds
    over = f"the {n_prompts} prompts" + (" and the seeds" if seeds > 1 else "")
    # A file may give runs different seeds (config/smollm2.yaml: SFT and GRPO 3, the others 1).
    per_run = (f"; each value the mean over {seeds} seeds ± their std" if fewest == seeds else
               f"; each value the mean over a run's seeds ({fewest} to {seeds}) ± their std where it has several")
    out = [f"Yardstick: {col}" + {True: ", higher is better", False: ", lower is better"}.get(higher, "")
           + (per_run if seeds > 1 else "; one seed per run")
           + f". Bars: the 95 % interval of a run's paired difference to its base (bootstrap over {over}); a "
             f"bar that crosses its base's line is no difference from it."]
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
            ties = [g for g in runs[1:] if intervals.tied(mean.loc[g, col], mean.loc[top, col])]
            if ties:
                text = f"{model}: no run leads; " + ", ".join([top, *ties]) + f" tie at {show(top)}"
            else:
                text = f"{model}: best is {top} ({show(top)})"
                if len(runs) > 1:
                    second = runs[1]
                    shown = abs(mean.loc[top, col] - mean.loc[second, col]) * (100 if k == "percent" else 1)
                    places = max(d, math.ceil(-math.log10(shown))) if shown else d
                    lead = intervals.compare(board["scores"], top, second, col)
                    text += ", " + versus(lead, leaderboard.settled(lead, higher), second, k, places,
                                          "a lead", "no lead", seeds, (top, second))
            if base is not None:
                if intervals.tied(mean.loc[top, col], mean.loc[base, col]):
                    text += "; it equals its base"
                else:
                    above = (mean.loc[top, col] > mean.loc[base, col]) == higher
                    gap = to_base.get(top)
                    verdict = "better" if above else "worse"
                    text += f"; {verdict} than its base {base} ({show(base)})" if gap is None else (
                        "; " + versus(gap, gap.lead, f"its base {base} ({show(base)})", k, d, verdict,
                                      "not distinguishable from it", seeds))
            per_model.append(text)
        out.append("Best per model on the yardstick: " + "; ".join(per_model) + "." if per_model else
                   "No run has a value on the yardstick.")
    close = [f"{c}: {b['group']} ≈ {b['runner_up']} "
             f"({unsettled(b['difference'], seeds, (b['group'], b['runner_up']))})"
             for c, b in best.items() if b["settled"] is False]
    if close:
        out.append("Leads not settled (≈ in the leaderboard): " + "; ".join(close) + ".")
    elif any(b["settled"] for b in best.values()):
        out.append("Where a run leads a leaderboard column (★), the 95 % interval of its paired difference over "
                   "the runner-up excludes zero, over prompts and seeds.")
    if seeds == 1:
        out.append("With one seed per run the intervals cover the prompts only, not a run's variation across seeds, "
                   "so no run's lead over another is called (★): it can be the seeds' alone. Set seeds: [1, 2, 3] "
                   "to measure it.")
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


def versus(diff: intervals.Difference | None, settled: bool | None, other: str, kind: str, places: int,
           yes: str, no: str, seeds: int, runs: tuple[str, str] | None = None) -> str:
    """One comparison in words: the paired difference to `other` with its interval, then `yes` where it is
    settled, else `no` and what would settle it."""
    if diff is None:
        return f"ahead of {other} (no per-prompt values: no interval, not called {yes})"
    text = f"{intervals.describe(diff, kind, places)} against {other}"
    return text + (f": {yes}" if settled else f": {no}; {unsettled(diff, seeds, runs)}")


def unsettled(diff: intervals.Difference, seeds: int, runs: tuple[str, str] | None = None) -> str:
    """Why a difference is not called a lead: with one seed per run the section says it once, in its last
    sentence; otherwise what would settle it."""
    if seeds == 1 and diff.lead and not diff.seeded:
        return "one seed each (below)"
    return intervals.needed(diff, runs)
