"""The leaderboard: every base model and run on the same yardstick, seeds folded into mean ± std.

Input: each eval job's metrics.json (snaketrl.evaluate.job.evaluate). Pure pandas: the report builds it.
"""

from __future__ import annotations

import math

import pandas as pd

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


def table(metrics: dict[str, dict], groups: dict[str, str]) -> tuple[pd.DataFrame, dict]:
    """Mean, std and seed count per group, bases first; and per column the best group and whether its lead
    is smaller than the seed spread (then it is no lead at all). A group with a diverged seed has no values:
    the seeds that did not diverge alone would flatter it."""
    df, better = frame(metrics, groups)
    values = [c for c in better if df[c].notna().any()]
    grouped = df.groupby("group", sort=False)
    diverged = grouped["diverged"].sum()
    mean, std = grouped[values].mean(), grouped[values].std(ddof=1)
    mean.loc[diverged > 0], std.loc[diverged > 0] = float("nan"), float("nan")
    info = grouped[["trainer", "model"]].first().assign(seeds=grouped.size(), diverged=diverged)
    order = sorted(mean.index, key=lambda g: (info.loc[g, "trainer"] != "base", info.loc[g, "model"], g))
    mean, std, info = mean.loc[order], std.loc[order], info.loc[order]
    best = {}
    for col in values:
        if better[col] is None or mean[col].notna().sum() < 2:
            continue
        ranked = mean[col].dropna().sort_values(ascending=not better[col])
        first, second = ranked.index[0], ranked.index[1]
        spread = (std[col].fillna(0).get(first, 0) or 0) + (std[col].fillna(0).get(second, 0) or 0)
        best[col] = {"group": first, "runner_up": second, "within_spread": bool(
            abs(ranked.iloc[0] - ranked.iloc[1]) < spread)}
    return {"mean": mean, "std": std, "info": info}, best


def to_html(board: dict, best: dict) -> str:
    """mean ± std cells; the best per column in bold, marked ≈ when its lead over the runner-up is smaller
    than their seed spread; a diverged group's cells say so."""
    mean, std, info = board["mean"], board["std"], board["info"]
    out = pd.DataFrame(index=list(mean.index))
    out["trainer"], out["model"] = info["trainer"], info["model"]
    out["seeds"] = [f"{n} ({d} diverged)" if d else n for n, d in zip(info["seeds"], info["diverged"])]
    for col in mean.columns:
        cells = []
        for group in mean.index:
            value, spread = mean.loc[group, col], std.loc[group, col]
            if info.loc[group, "diverged"]:
                cells.append("diverged")
                continue
            if pd.isna(value):
                cells.append("–")
                continue
            text = f"{value:.3g}" + (f" ± {spread:.2g}" if pd.notna(spread) else "")
            if best.get(col, {}).get("group") == group:
                text = f"<b>{text}</b>" + (" ≈" if best[col]["within_spread"] else " ★")
            cells.append(text)
        out[col] = cells
    return out.to_html(escape=False, classes="summary leaderboard")
