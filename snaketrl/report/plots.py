"""Curves from trainer_state.json: every numeric key of log_history, grouped, nothing hard-coded per trainer."""

from __future__ import annotations

import json
from collections import defaultdict

import pandas as pd

from snaketrl.report.figures import pyplot

# Bookkeeping columns, and the keys of the final summary entry (one value per run, not a curve).
NOT_CURVES = {"step", "epoch", "total_flos", "train_loss", "train_runtime", "train_samples_per_second",
              "train_steps_per_second", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def log_frame(state: dict) -> pd.DataFrame:
    """log_history as a frame indexed by step; train and eval entries merged on their step."""
    df = pd.DataFrame(state["log_history"])
    if df.empty:
        return df
    df = df.groupby("step", sort=True).first()
    return df.select_dtypes("number")


def metric_group(key: str) -> str:
    """Group name: eval_X joins X; 'rewards/chosen' joins 'rewards'; the rest stand alone."""
    base = key.removeprefix("eval_")
    if "/" in base:
        return base.split("/", 1)[0]
    return base


def group_metrics(columns, first=()) -> dict[str, list[str]]:
    """Groups in reading order: the trainer's headline groups (`first`) lead, e.g. GRPO's reward
    before its loss, which sits near zero by design."""
    groups: dict[str, list[str]] = defaultdict(list)
    for col in columns:
        if col not in NOT_CURVES:
            groups[metric_group(col)].append(col)
    order = [*dict.fromkeys(metric_group(k) for k in first), "loss", "rewards", "logps", "logits",
             "mean_token_accuracy", "learning_rate", "grad_norm"]
    return dict(sorted(groups.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def plot_frame(df: pd.DataFrame, path, title: str, first=()) -> None:
    plt = pyplot()

    groups = group_metrics(df.columns, first)
    n = max(1, len(groups))
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3 * rows), squeeze=False)
    for ax, (group, keys) in zip(axes.flat, groups.items()):
        df[keys].dropna(how="all").plot(ax=ax, marker=".", linewidth=1)
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_run(state_file, png, csv, title: str, first=()) -> None:
    from snaketrl.io import atomic

    state = json.loads(open(state_file).read())
    with atomic(csv) as tmp:
        pd.DataFrame(state["log_history"]).to_csv(tmp, index=False)
    with atomic(png) as tmp:
        plot_frame(log_frame(state), tmp, title, first)
