"""How sure a comparison is: the paired difference of two runs' per-prompt scores, with a 95 % interval from a
bootstrap over the held-out prompts and the seeds (scipy.stats.bootstrap), and for a tie the number of seeds (or
prompts) a difference of the observed size would need.

Input: the rows of the evaluation's completions (the `completions` table of results/evaluation.sqlite, or the
completions.jsonl it is built from): run, seed, prompt_id, reference and one column per score. The method is
stated in docs/evaluation.md, with a snippet that recomputes one interval from the SQLite.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

CONFIDENCE = 0.95
POWER = 0.8
RESAMPLES = 9999
RANDOM_STATE = 0  # fixed: the same results give the same report
WIN = " win"  # a score's win-rate column: "<score> win"


def prompt_scores(rows: list[dict], groups: dict[str, str]) -> pd.DataFrame:
    """One row per (group, eval job, prompt_id), one column per score and per score's win against the job's
    reference (1 above it, 0.5 equal, 0 below; NaN where either score is missing): the per-prompt values the
    leaderboard's score and win columns are the means of."""
    df = pd.DataFrame(rows)
    scores = [c for c in df.columns if c.startswith(("fn_", "rm_"))]
    if not scores or not {"run", "prompt_id"} <= set(df.columns):
        return pd.DataFrame()
    df = df.assign(group=[groups.get(r, r) for r in df["run"]])
    if "reference" in df:
        by_job = df.set_index(["run", "prompt_id"])
        for score in scores:
            ref = by_job[score].reindex(pd.MultiIndex.from_arrays([df["reference"], df["prompt_id"]])).to_numpy()
            own = df[score].to_numpy(dtype=float)
            win = np.where(own > ref, 1.0, np.where(own == ref, 0.5, 0.0))
            df[score + WIN] = np.where(np.isnan(own) | np.isnan(ref.astype(float)), np.nan, win)
    keep = ["group", "run", "prompt_id", *scores, *(s + WIN for s in scores if s + WIN in df)]
    return df[keep].astype({c: float for c in keep[3:]}).set_index(["group", "run", "prompt_id"]).sort_index()


def matrix(scores: pd.DataFrame, group: str, column: str) -> pd.DataFrame | None:
    """A group's per-prompt values of one column: one row per eval job (seed), one column per prompt_id. None
    when the group or column has none."""
    if scores.empty or column not in scores or group not in scores.index.get_level_values("group"):
        return None
    values = scores.loc[group, column].unstack("prompt_id")
    return None if values.isna().all().all() else values


@dataclass(frozen=True)
class Difference:
    """a − b on one column: the mean over prompts of the seed-averaged per-prompt difference, its 95 % interval,
    what it rests on, and for a tie the sample size the power rule asks for (None: no difference to detect)."""
    difference: float
    low: float
    high: float
    prompts: int
    seeds: tuple[int, int]
    needed: int | None
    unit: str  # "seeds" (per run) or "prompts"
    needed_prompts: int | None = None  # the power rule on the prompts alone, where `unit` is seeds

    @property
    def lead(self) -> bool:
        """The interval excludes zero."""
        return self.low > 0 or self.high < 0

    @property
    def seeded(self) -> bool:
        """Both runs have several seeds: the interval counts how a run varies with its seed."""
        return min(self.seeds) > 1


def _statistic(a: np.ndarray, b: np.ndarray):
    """The mean paired difference for scipy's resampled index samples: prompts (one index set for both runs:
    the pairing), then the seeds of each run that has several. Leading axes are scipy's batch."""
    def statistic(prompts, *seeds, axis=-1):
        seeds = list(seeds)
        means = []
        for runs in (a, b):
            if len(runs) > 1:
                i = seeds.pop(0).astype(int)
                means.append(runs[i].mean(axis=-2))  # (..., seeds, prompts) -> (..., prompts)
            else:
                means.append(runs[0])
        d = np.broadcast_to(means[0] - means[1], (*prompts.shape[:-1], a.shape[1]))
        return np.take_along_axis(d, prompts.astype(int), axis=-1).mean(axis=-1)
    return statistic


def z_power() -> float:
    """z_{0.975} + z_{0.8}: a two-sided 5 % test that finds a true difference of the given size 80 % of the time."""
    from scipy.stats import norm

    return float(norm.ppf(1 - (1 - CONFIDENCE) / 2) + norm.ppf(POWER))


def tied(a: float, b: float) -> bool:
    """Equal to the digits a mean over seeds keeps (two means of the same values may differ in the last bit)."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def sample_size(sd: float, delta: float) -> int | None:
    """n ≈ (z_{0.975} + z_{0.8})² σ² / δ², rounded up; None for δ = 0 (nothing to detect)."""
    if not math.isfinite(delta) or tied(delta, 0):
        return None
    return max(2, math.ceil((z_power() * sd / delta) ** 2))


def spread_seeds(m: np.ndarray, widen: float) -> np.ndarray:
    """A run's seeds × prompts with each seed's deviation from the seeds' mean scaled by √(n/(n−1)) · widen.
    √(n/(n−1)): resampling n seeds then varies their mean by the unbiased s²/n, not the plain bootstrap's
    (n−1)/n of it. widen (seed_widening): a few seeds' spread is itself uncertain. The means are unchanged."""
    n = len(m)
    return m if n < 2 else m.mean(axis=0) + math.sqrt(n / (n - 1)) * widen * (m - m.mean(axis=0))


def seed_widening(*seeds: int) -> float:
    """t_{0.975, df} / z_{0.975}, df = Σ (n − 1) over the runs with several seeds: the interval a t test would
    give a difference measured on that few seeds, against the normal one a bootstrap approaches (with 3 seeds
    per run, 1.42; docs/evaluation.md gives a simulation of planted ties with and without it)."""
    from scipy.stats import norm, t

    df = sum(n - 1 for n in seeds if n > 1)
    q = 1 - (1 - CONFIDENCE) / 2
    return float(t.ppf(q, df) / norm.ppf(q)) if df else 1.0


def paired(a: pd.DataFrame, b: pd.DataFrame) -> Difference | None:
    """a − b (each: matrix(), seeds × prompt_id) on the prompts both scored in every seed. The interval: scipy's
    bootstrap (BCa, RESAMPLES, RANDOM_STATE) resampling the prompts, once for both runs, and independently the
    seeds of each run with several (the seeds of two runs are not paired), their deviations widened first
    (spread_seeds, seed_widening); a degenerate distribution (every resample equal) is its single value. The
    tie's sample size (sample_size) from the scores as they are. None with fewer than two common prompts."""
    from scipy.stats import DegenerateDataWarning, bootstrap

    common = [p for p in a.columns if p in b.columns and a[p].notna().all() and b[p].notna().all()]
    if len(common) < 2:
        return None
    raw_x, raw_y = a[common].to_numpy(float), b[common].to_numpy(float)
    widen = seed_widening(len(raw_x), len(raw_y))
    x, y = spread_seeds(raw_x, widen), spread_seeds(raw_y, widen)
    per_prompt = raw_x.mean(axis=0) - raw_y.mean(axis=0)
    delta = float(per_prompt.mean())
    data = [np.arange(len(common))] + [np.arange(len(m)) for m in (x, y) if len(m) > 1]
    with warnings.catch_warnings():  # a degenerate distribution: handled below
        warnings.simplefilter("ignore", DegenerateDataWarning)
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        result = bootstrap(data, _statistic(x, y), paired=False, vectorized=True, confidence_level=CONFIDENCE,
                           n_resamples=RESAMPLES, batch=1000, method="BCa", rng=np.random.default_rng(RANDOM_STATE))
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    if np.ptp(result.bootstrap_distribution) == 0:  # scipy gives NaN for BCa then
        low = high = float(result.bootstrap_distribution[0])
    by_prompts = sample_size(float(per_prompt.std(ddof=1)), delta)
    if len(x) > 1 and len(y) > 1:  # seeds per run: the spread of one seed's mean minus another's
        sd = math.sqrt(raw_x.mean(axis=1).var(ddof=1) + raw_y.mean(axis=1).var(ddof=1))
        return Difference(delta, low, high, len(common), (len(x), len(y)), sample_size(sd, delta), "seeds", by_prompts)
    return Difference(delta, low, high, len(common), (len(x), len(y)), by_prompts, "prompts")


def compare(scores: pd.DataFrame, first: str, second: str, column: str) -> Difference | None:
    """first − second on a column, from the per-prompt values (prompt_scores); None where either has none."""
    a, b = matrix(scores, first, column), matrix(scores, second, column)
    return None if a is None or b is None else paired(a, b)


def signed(value: float, kind: str, decimals: int | None) -> str:
    """A difference in its column's unit (percentage points for a share), with its sign."""
    from snaketrl.report.format import spread, with_sign

    return with_sign(value, spread(abs(value), kind, decimals), plus=True)


def describe(d: Difference, kind: str, decimals: int | None) -> str:
    """'+0.120 (95 % interval +0.050 to +0.200)': the difference and its interval in the column's unit."""
    unit = " points" if kind == "percent" else ""
    return (f"{signed(d.difference, kind, decimals)}{unit} (95 % interval {signed(d.low, kind, decimals)} to "
            f"{signed(d.high, kind, decimals)})")


def more_seeds(d: Difference, runs: tuple[str, str] | None) -> str:
    """The setting that gives a comparison's one-seed run more seeds: where the other run has several, the config's
    seeds are already several and the run's own entry holds it to one, so the advice names that entry."""
    single = [run for run, n in zip(runs or (), d.seeds) if n == 1]
    if len(single) != 1:
        return "set seeds: [1, 2, 3]"
    return f"set runs.{single[0]}.seeds: [1, 2, 3]"


def needed(d: Difference, runs: tuple[str, str] | None = None) -> str:
    """What a tie would need: the power rule's sample size for a difference of the observed size. `runs`: the
    two groups compared (a − b), so that the advice names the ones with one seed."""
    # A one-seed run against one with several: where the prompts it has would do, the interval is wide from the
    # other run's seeds, and more seeds for both is what would settle it.
    enough_prompts = d.unit == "prompts" and d.needed is not None and d.needed <= d.prompts
    if not d.seeded and (d.lead or enough_prompts):
        return "with one seed a run's difference from another can be its seed's alone: " + more_seeds(d, runs)
    if d.needed is None:
        return "no difference observed, so no number of seeds would show one"
    if d.unit == "seeds":
        if d.needed > min(d.seeds):
            return f"a difference this size would need about {d.needed} seeds per run (has {min(d.seeds)})"
        if d.needed_prompts is not None and d.needed_prompts > d.prompts:
            return f"a difference this size would need about {d.needed_prompts:,} prompts (has {d.prompts})"
        # Each alone meets the power rule; the interval counts both spreads at once (and widens a few seeds').
        return (f"not settled with {min(d.seeds)} seeds per run and {d.prompts:,} prompts, though the power rule "
                f"asks about {d.needed} and {d.needed_prompts:,} for a difference this size taken one at a time: "
                f"more seeds would narrow it")
    return f"a difference this size would need about {d.needed:,} prompts (has {d.prompts})"
