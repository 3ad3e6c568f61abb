"""The report's sweep section: each sweep's runs (seeds folded) as a table and a plot, read by the
yardstick when every member was evaluated, else by the trainer's headline metric.
"""

from __future__ import annotations

from snaketrl.report import leaderboard
from snaketrl.report.figures import data_uri, last_value, png_bytes, pyplot
from snaketrl.trainers import REGISTRY


def yardstick(better: dict[str, bool | None]) -> str | None:
    """The leaderboard column a sweep is read by: the first reward-model score (the report's bar chart),
    else the first reward function's, else held-out NLL."""
    scores = [c for c in better if c.startswith(("rm_", "fn_")) and not c.endswith(" win")]
    ranked = sorted(scores, key=lambda c: not c.startswith("rm_")) + ["NLL"]
    return next((c for c in ranked if c in better), None)


def _metric(members: dict[str, dict], states: dict[str, dict], metrics: dict[str, dict]):
    """(label, where it comes from, higher is better?, value per run): the yardstick when every member was
    evaluated, else the trainer's headline metric (last logged value) from training."""

    if metrics and all(n in metrics for n in members):
        df, better = leaderboard.frame({n: metrics[n] for n in members}, {})
        label = yardstick(better)
        if label is not None and df[label].notna().all():
            return label, "evaluation", better[label], dict(zip(df["job"], df[label]))
    spec = REGISTRY[next(iter(members.values()))["trainer"]]
    keys = [*spec.headline, spec.overlay]
    histories = {n: states.get(n, {}).get("log_history", []) for n in members}
    key = next((k for k in keys if all(last_value(h, k) is not None for h in histories.values())),
               next((k for k in keys if any(last_value(h, k) is not None for h in histories.values())), keys[0]))
    return key, "training log (last value)", None, {n: last_value(h, key) for n, h in histories.items()}


def sweep_table(members: dict[str, dict], values: dict[str, float]):
    """One row per combination (seeds folded): the swept values, then mean, std and number of seeds."""
    import pandas as pd

    keys = sorted(next(iter(members.values()))["swept"])
    rows = [{**run["swept"], "group": run["group"], "value": values.get(name)} for name, run in members.items()]
    df = pd.DataFrame(rows)
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    grouped = df.groupby("group", sort=False)
    table = grouped[keys].first().assign(mean=grouped["value"].mean(), std=grouped["value"].std(ddof=1),
                                         seeds=grouped.size())
    try:
        table = table.sort_values(keys)
    except TypeError:  # a field swept over values of mixed types (0.5 and "auto")
        table = table.sort_values(keys, key=lambda column: column.astype(str))
    return table.reset_index(drop=True)


def _table(table, label: str, higher: bool | None) -> dict:
    """mean ± std cells (std only with several seeds), the best combination in bold; the swept values as
    the config wrote them (a learning rate reads 0.005)."""
    import pandas as pd

    from snaketrl.report.format import cell, column, decimals_for, number
    from snaketrl.report.format import table as make_table

    keys = [c for c in table.columns if c not in ("mean", "std", "seeds")]
    best = None
    if higher is not None and table["mean"].notna().any():
        best = table["mean"].idxmax() if higher else table["mean"].idxmin()
    decimals = decimals_for(table["mean"].dropna().tolist())
    rows = []
    for i, row in table.iterrows():
        text = number(None) if pd.isna(row["mean"]) else number(row["mean"], "float", decimals) + (
            "" if pd.isna(row["std"]) else f" ± {number(row['std'], 'float', decimals)}")
        rows.append([*(row[k] for k in keys), cell(text, None if pd.isna(row["mean"]) else float(row["mean"]),
                                                   bold=i == best), int(row["seeds"])])
    columns = [*(column(k) for k in keys), column(label, "float"), column("seeds", "int")]
    return make_table(columns, rows, cls="sweep")


def sweep_png(table, label: str, title: str) -> bytes:
    """The metric against each swept value (one panel per key), one line per setting of the other keys;
    error bars: std over seeds."""
    plt = pyplot()

    keys = [c for c in table.columns if c not in ("mean", "std", "seeds")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        others = [k for k in keys if k != key]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in table[key])
        order = sorted(table[key].unique(), key=lambda v: (v if numeric else str(v)))
        for setting, part in (table.groupby(others, sort=False) if others else [((), table)]):
            part = part.set_index(key).loc[[v for v in order if v in set(part[key])]]
            x = list(part.index) if numeric else [order.index(v) for v in part.index]
            setting = setting if isinstance(setting, tuple) else (setting,)
            ax.errorbar(x, part["mean"], yerr=part["std"].fillna(0), marker="o", capsize=3,
                        label=", ".join(f"{k}={v}" for k, v in zip(others, setting)) or None)
        if numeric and min(order) > 0 and max(order) / min(order) >= 10:
            ax.set_xscale("log")
            ax.minorticks_off()
        # Ticks at the swept values, as written in the run names.
        ax.set_xticks(order if numeric else range(len(order)), [str(v) for v in order])
        ax.set_xlabel(key)
        ax.set_ylabel(label, fontsize=8)
        if others:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return png_bytes(fig)


def sweep_sections(runs: dict[str, dict], states: dict[str, dict], metrics: dict[str, dict]) -> list[dict]:
    """Per swept run (a trainer and model): its metric per combination as a table and a plot. `runs`: the
    resolved runs (snaketrl.config.resolve_runs), `states`: trainer_state per run, `metrics`: eval job -> metrics."""

    sweeps: dict[str, dict[str, dict]] = {}
    for name, run in runs.items():
        if run.get("sweep"):
            sweeps.setdefault(run["sweep"], {})[name] = run
    sections = []
    for sweep, members in sorted(sweeps.items()):
        first = next(iter(members.values()))
        label, source, higher, values = _metric(members, states, metrics)
        table = sweep_table(members, values)
        sections.append({
            "name": sweep, "trainer": first["trainer"], "model": first["model"], "metric": label,
            "source": source, "combinations": len(table), "table": _table(table, label, higher),
            "png": data_uri(sweep_png(table, label, f"{sweep}: {label}")),
        })
    return sections
