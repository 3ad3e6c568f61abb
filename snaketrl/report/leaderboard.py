"""The leaderboard: every base model and run on the same yardstick, seeds folded into mean ± std, the best per
column starred only where its paired interval over the runner-up excludes zero (snaketrl.report.intervals).

Input: each eval job's metrics.json (snaketrl.evaluate.job.evaluate). Pure pandas: the report builds it.
"""

from __future__ import annotations

import math

import pandas as pd

from snaketrl.report import intervals
from snaketrl.trainers import REGISTRY

# (column, where in metrics.json, higher is better? None: no "best", a property to read, not a goal)
FIXED = [
    ("NLL", ("references", "nll"), False),
    ("pref. acc.", ("pairs", "accuracy"), True),
    ("logp acc.", ("pairs", "logp_accuracy"), True),
    ("length", ("mean_length",), None),
    ("distinct-2", ("distinct_2",), True),
    ("KL to start", ("kl_k1",), None),
]


def _get(metrics: dict, path: tuple):
    for key in path:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics if isinstance(metrics, (int, float)) and not isinstance(metrics, bool) else None


def _finite(value) -> bool:
    return value is None or math.isfinite(value)


def columns(metrics: dict) -> list[tuple[str, tuple, bool | None]]:
    """The leaderboard's columns: every score's mean and win rate against the base, then the fixed ones,
    then lm-eval's numbers."""
    cols = []
    for score in sorted(metrics.get("scores", {})):
        cols += [(f"{score}", ("scores", score, "mean"), True), (f"{score} win", ("scores", score, "win_rate"), True)]
    cols += FIXED
    for task, values in sorted((metrics.get("lm_eval") or {}).items()):
        for key in sorted(values) if isinstance(values, dict) else []:
            # lm-eval names metrics "metric,filter"; other keys (sample_len, alias) are not scores.
            if "," in key and "stderr" not in key and isinstance(values[key], (int, float)):
                cols.append((f"{task} {key}", ("lm_eval", task, key), True))
    return cols


def frame(metrics: dict[str, dict], groups: dict[str, str]) -> pd.DataFrame:
    """One row per eval job: its group (the run without its seed, or base-<model>), trainer, model, seed,
    whether it diverged (a value NaN or infinite: evaluated before the job refused such models) and every
    column's value, those of a diverged job left out."""
    cols = {}
    for m in metrics.values():
        for c in columns(m):
            cols.setdefault(c[0], c)
    rows = []
    for name, m in metrics.items():
        row = {"job": name, "group": groups.get(name, name), "trainer": m.get("trainer"), "model": m.get("model"),
               "seed": m.get("seed")}
        values = {label: _get(m, path) for label, path, _ in cols.values()}
        row["diverged"] = not all(map(_finite, values.values()))
        row.update({label: None if row["diverged"] else value for label, value in values.items()})
        rows.append(row)
    return pd.DataFrame(rows), {label: better for label, _, better in cols.values()}


def trainer_rank(trainer: str) -> tuple:
    """Trainers in the registry's order (SFT, DPO, reward, GRPO, PPO, ...): the bases, the reference, first."""
    order = ["base", *REGISTRY]
    return (order.index(trainer) if trainer in order else len(order), trainer)


def table(metrics: dict[str, dict], groups: dict[str, str],
          scores: pd.DataFrame | None = None) -> tuple[dict, dict]:
    """Mean, std and seed count per group, bases first; per column the best run, its runner-up and, where both
    have per-prompt values (`scores`: snaketrl.report.intervals.prompt_scores), their paired difference with its
    95 % interval: a lead is settled only where that interval excludes zero. A base model is the reference every
    run is read against, not a contestant; a column whose two best runs are equal has no best (a tie is no
    lead). A group with a diverged seed has no values: the seeds that did not diverge alone would flatter it."""
    df, better = frame(metrics, groups)
    values = [c for c in better if df[c].notna().any()]
    grouped = df.groupby("group", sort=False)
    diverged = grouped["diverged"].sum()
    mean, std = grouped[values].mean(), grouped[values].std(ddof=1)
    mean.loc[diverged > 0], std.loc[diverged > 0] = float("nan"), float("nan")
    info = grouped[["trainer", "model"]].first().assign(seeds=grouped.size(), diverged=diverged)
    order = sorted(mean.index, key=lambda g: (info.loc[g, "trainer"] != "base", info.loc[g, "model"],
                                              trainer_rank(info.loc[g, "trainer"]), g))
    mean, std, info = mean.loc[order], std.loc[order], info.loc[order]
    scores = pd.DataFrame() if scores is None else scores
    runs = [g for g in mean.index if info.loc[g, "trainer"] != "base"]
    best = {}
    for col in values:
        ranked = mean.loc[runs, col].dropna().sort_values(ascending=not better[col])
        if better[col] is None or len(ranked) < 2 or intervals.tied(ranked.iloc[0], ranked.iloc[1]):
            continue
        first, second = ranked.index[0], ranked.index[1]
        difference = intervals.compare(scores, first, second, col)
        best[col] = {"group": first, "runner_up": second, "lead": abs(ranked.iloc[0] - ranked.iloc[1]),
                     "difference": difference, "settled": settled(difference, better[col])}
    return {"mean": mean, "std": std, "info": info, "scores": scores}, best


def settled(difference: intervals.Difference | None, higher: bool) -> bool | None:
    """Whether a run's lead over another (difference: leader − runner-up) holds: both have several seeds and
    its interval excludes zero on the side the column counts as better. With one seed the interval covers the
    prompts only, and a difference between two runs can be their seeds' alone. None without per-prompt values."""
    if difference is None:
        return None
    return difference.seeded and (difference.low > 0 if higher else difference.high < 0)


def verdict(lead: dict, kind: str, decimals: int | None) -> str:
    """A leader's lead over its runner-up in words: its paired difference and interval, and for a tie what
    would settle it."""
    d = lead["difference"]
    if d is None:
        return f"ahead of {lead['runner_up']}; no per-prompt values, so no interval: not called a lead"
    text = f"{intervals.describe(d, kind, decimals)} over {lead['runner_up']}"
    return text + (": a lead" if lead["settled"] else
                   f": not settled; {intervals.needed(d, (lead['group'], lead['runner_up']))}")


def kind(label: str) -> str:
    """How a column's values read (snaketrl.report.format): rates and accuracies as percentages."""
    shares = (" win", "pref. acc.", "logp acc.", "distinct-2")
    if label.endswith(shares) or any(k in label for k in ("acc", "exact_match")):
        return "percent"
    return "float"


def primary(labels: list[str]) -> set[str]:
    """The columns the default view shows: every reward model's score and win rate (the fixed reward
    functions' where no reward model judges), held-out NLL and preference accuracy; the rest fold away."""
    judged = [c for c in labels if c.startswith("rm_")] or [c for c in labels if c.startswith("fn_")
                                                             and not c.endswith(" win")]
    return {*judged, "NLL", "pref. acc."}


def to_table(board: dict, best: dict, moved: dict[str, str | None] | None = None) -> dict:
    """The leaderboard as a report table (snaketrl.report.format.table): mean ± std cells, one number of
    decimals per column; the best per column in bold, ★ where the 95 % interval of its paired difference over
    the runner-up excludes zero, ≈ where it does not (its tooltip: the interval, and what would settle it), bold
    alone where the column has no per-prompt values; a diverged group's cells say so. `moved`: group -> None
    where its completions differ from its start model's, else that start model (it did not move)."""
    from snaketrl.report.format import cell, column, decimals_for, number, spread
    from snaketrl.report.format import table as make_table

    mean, std, info, moved = board["mean"], board["std"], board["info"], moved or {}
    shown = primary(list(mean.columns))
    columns = [column("run"), column("trainer"), column("model", secondary=True), column("seeds", "int", secondary=True),
               column("moved", title="no: its completions are its start model's for every prompt")]
    for col in mean.columns:
        k = kind(col)
        decimals = 1 if k == "percent" else decimals_for(mean[col].dropna().tolist())
        if best.get(col, {}).get("lead"):  # enough decimals that the leader and runner-up read apart
            shown_lead = best[col]["lead"] * (100 if k == "percent" else 1)
            decimals = max(decimals, min(6, math.ceil(-math.log10(shown_lead))))
        win = col.endswith(" win")  # read beside its score: "win", the score's name in its tooltip
        columns.append(column(col, k, secondary=col not in shown, decimals=decimals, label="win" if win else None,
                              title=f"{col[:-4]}: win rate against the base's completion" if win else ""))
    rows = []
    for group in mean.index:
        n, d = info.loc[group, "seeds"], info.loc[group, "diverged"]
        if info.loc[group, "trainer"] == "base":
            moves = cell("reference", "")
        elif group in moved:
            start = moved[group]
            moves = cell("no" if start else "yes", "no" if start else "yes", cls="unmoved" if start else "",
                         title=f"the same completion as {start} for every prompt" if start else "")
        else:
            moves = cell("–", None)
        row = [group, info.loc[group, "trainer"], info.loc[group, "model"],
               cell(f"{n} ({d} diverged)", int(n)) if d else int(n), moves]
        for col, c in zip(mean.columns, columns[5:]):
            value, sd = mean.loc[group, col], std.loc[group, col]
            if d:
                row.append(cell("diverged", None, cls="diverged"))
                continue
            if pd.isna(value):
                row.append(cell(number(None), None))
                continue
            text = number(value, c["kind"], c["decimals"])
            if pd.notna(sd):
                text += f" ± {spread(sd, c['kind'], c['decimals'])}"
            lead = best.get(col, {})
            if lead.get("group") != group:
                row.append(cell(text, float(value)))
                continue
            row.append(cell(text, float(value), bold=True, mark={True: "★", False: "≈"}.get(lead["settled"], ""),
                            title=verdict(lead, c["kind"], c["decimals"])))
        rows.append(row)
    return make_table(columns, rows, cls="leaderboard")
