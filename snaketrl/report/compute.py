"""Equal compute: what each run cost (tokens, FLOPs, seconds, peak memory; snaketrl.train.cost counts them in
training) and the yardstick and each trainer's curve against that cost, so trainers are compared per unit of
compute rather than per step (an SFT step, a DPO pair step with its reference forward and a GRPO step with its
generations are different amounts of work).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from snaketrl.report.figures import png_bytes, pyplot
from snaketrl.report.format import column, table
from snaketrl.report.plots import log_frame
from snaketrl.trainers import REGISTRY

COST = ("flops", "train_seconds")


def needs(run: str, runs: dict[str, dict]) -> list[str]:
    """The run and every run it needs to exist (its start policy, its reward model, theirs), each once."""
    out, todo = [], [run]
    while todo:
        name = todo.pop()
        if name in runs and name not in out:
            out.append(name)
            todo += [runs[name][k] for k in ("policy", "reward_model") if runs[name].get(k)]
    return out


def chain_cost(runs: dict[str, dict], metrics: dict[str, dict]) -> dict[str, dict]:
    """Per run: its own FLOPs and training seconds, and those of everything it needs ("with start"): what it
    took to get this model from the base. None where a run recorded no cost (trained before it was counted)."""
    out = {}
    for run in runs:
        own = {k: (metrics.get(run) or {}).get(k) for k in COST}
        chain = [metrics.get(r) or {} for r in needs(run, runs)]
        total = {k: sum(m[k] for m in chain) if all(m.get(k) is not None for m in chain) else None for k in COST}
        out[run] = {"own": own, "chain": total}
    return out


def cost_table(runs: dict[str, dict], metrics: dict[str, dict], costs: dict[str, dict]) -> dict:
    """One row per run: tokens (real, padded, forward-only), FLOPs (trained, forward-only, total, with what it
    needs), training seconds and peak memory."""
    cuda = any((metrics.get(r) or {}).get("cuda_peak_bytes") is not None for r in runs)
    columns = [column("run"), column("trainer"),
               column("real tokens", "si", title="non-pad tokens of the trained forwards"),
               column("padded tokens", "si", title="every token the trained forwards embedded, padding included"),
               column("efficiency", "percent", secondary=True, title="real / padded"),
               column("forward-only tokens", "si", secondary=True,
                      title="tokens of forwards without gradients: generation (prompts included), reference, "
                            "reward and value models"),
               column("FLOPs trained", "si", secondary=True, title="forward and backward of the trained passes"),
               column("FLOPs forward-only", "si", secondary=True),
               column("FLOPs", "si", title="the run's own training FLOPs"),
               column("FLOPs with start", "si", title="with the runs it needs: its start policy, its reward model"),
               column("seconds", "seconds", title="wall-clock of the optimizer steps (evaluation and checkpoints "
                                                  "excluded)"),
               column("peak RSS", "bytes", title="the training process's peak resident memory")]
    if cuda:
        columns.append(column("CUDA peak", "bytes", title="torch.cuda.max_memory_allocated"))
    rows = []
    for run, entry in runs.items():
        m = metrics.get(run) or {}
        row = [run, entry["trainer"], m.get("real_tokens"), m.get("processed_tokens"), m.get("token_efficiency"),
               m.get("forward_only_tokens"), m.get("flops_trained"), m.get("flops_forward_only"), m.get("flops"),
               costs[run]["chain"]["flops"], m.get("train_seconds"), m.get("peak_rss_bytes")]
        rows.append(row + ([m.get("cuda_peak_bytes")] if cuda else []))
    return table(columns, rows, cls="cost")


def _cost_axis(ax, values, unit: str, scale: str = "log") -> None:
    """`scale` ("log", or "symlog" where zeros must stay on the axis) where the values span a decade or more,
    else linear; ticks in k/M/G/T of `unit`, never in e-notation."""
    from matplotlib.ticker import EngFormatter, MaxNLocator, NullFormatter

    positive = [v for v in values if v and v > 0]
    if positive and max(positive) / min(positive) >= 10:
        ax.set_xscale(scale, **({"linthresh": min(positive)} if scale == "symlog" else {}))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.xaxis.set_major_formatter(EngFormatter(unit=unit))


def yardstick_png(board: dict, col: str, higher: bool | None, groups: dict[str, str], costs: dict[str, dict],
                  runs: dict[str, dict]) -> bytes | None:
    """The yardstick against each run group's training FLOPs and seconds (with what it needs; means over
    seeds), on shared axes: a marker per trainer, a colour per model, each base a dashed line."""
    plt = pyplot()

    mean, info = board["mean"], board["info"]
    members: dict[str, list[str]] = {}
    for run in runs:
        members.setdefault(groups.get(run, run), []).append(run)
    points = []
    for group in mean.index:
        cost = [costs[r]["chain"] for r in members.get(group, [])]
        if info.loc[group, "trainer"] == "base" or not cost or mean.loc[group, col] != mean.loc[group, col]:
            continue
        if any(c[k] is None for c in cost for k in COST):
            continue
        points.append((group, *(float(np.mean([c[k] for c in cost])) for k in COST)))
    if not points:
        return None
    models = list(dict.fromkeys(info["model"]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    trainers = list(dict.fromkeys(info.loc[g, "trainer"] for g, *_ in points))
    markers = dict(zip(trainers, "osD^vP*Xh"))
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4), sharey=True)
    for ax, i, label, unit in ((axes[0], 1, "training FLOPs", "FLOP"), (axes[1], 2, "training time", "s")):
        for group, *cost in points:
            model, trainer = info.loc[group, "model"], info.loc[group, "trainer"]
            ax.plot(cost[i - 1], mean.loc[group, col], markers[trainer], color=colors[model], markersize=8)
        for group in mean.index:
            if info.loc[group, "trainer"] == "base" and mean.loc[group, col] == mean.loc[group, col]:
                ax.axhline(mean.loc[group, col], color=colors[info.loc[group, "model"]], linestyle="--",
                           linewidth=1)
        _cost_axis(ax, [p[i] for p in points], unit)
        ax.set_xlabel(f"{label} (with its start policy and reward model)", fontsize=8)
        ax.grid(alpha=0.3)
    direction = {True: " (higher is better)", False: " (lower is better)"}.get(higher, "")
    axes[0].set_ylabel(col + direction, fontsize=8)
    handles = [plt.Line2D([], [], linestyle="", marker=markers[t], color="grey", label=t) for t in trainers]
    handles += [plt.Line2D([], [], color=colors[m], label=m) for m in models]
    handles.append(plt.Line2D([], [], color="grey", linestyle="--", label="base (start)"))
    axes[1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    return png_bytes(fig)


def flops_at(steps, metrics: dict) -> np.ndarray:
    """Cumulative training FLOPs at each of `steps` (step 0: none yet), from metrics.json's cost_by_step."""
    curve = metrics.get("cost_by_step") or {}
    return np.interp(np.asarray(steps, dtype=float), [0, *curve.get("step", [])], [0, *curve.get("flops", [])])


def curves_png(runs: dict[str, dict], states: dict[str, dict], metrics: dict[str, dict]) -> bytes | None:
    """Each trainer's curve (its eval curve where it evaluates during training, else its training curve)
    against the run's cumulative training FLOPs; one panel per trainer on one shared FLOPs axis."""
    plt = pyplot()

    by_trainer: dict[str, list[str]] = {}
    for run, entry in runs.items():
        if (metrics.get(run) or {}).get("cost_by_step"):
            by_trainer.setdefault(entry["trainer"], []).append(run)
    if not by_trainer:
        return None
    cols = min(3, len(by_trainer))
    n_rows = -(-len(by_trainer) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3 * n_rows), squeeze=False, sharex=True)
    xs = []
    for ax, (trainer, names) in zip(axes.flat, by_trainer.items()):
        key = REGISTRY[trainer].overlay
        for run in names:
            df = log_frame(states[run])
            # The eval curve; a trainer evaluated once, after training (GRPO), has its training curve instead.
            col = f"eval_{key}" if df.get(f"eval_{key}", pd.Series()).count() > 1 else key
            if col not in df:
                continue
            series = df[col].dropna()
            x = flops_at(series.index, metrics[run])
            xs += list(x)
            ax.plot(x, series.values, marker=".", label=run)
        ax.set_title(f"{trainer}: {col}", fontsize=9)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    for ax in axes.flat:
        _cost_axis(ax, xs, "FLOP", "symlog")  # step 0, before training, stays on the axis
        ax.set_xlabel("cumulative training FLOPs", fontsize=8)
    for ax in list(axes.flat)[len(by_trainer):]:
        ax.axis("off")
    return png_bytes(fig)
