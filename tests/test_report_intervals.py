"""The report's leads rest on paired intervals (snaketrl.report.intervals): recomputed from the evaluation
database they are the report's; a planted tie gets no ★, a planted difference does; a tie says what would settle it."""

import contextlib
import io
import math
import re
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from snaketrl.evaluate.scoring import mean_std, win_rate
from snaketrl.evaluate.storage import collect
from snaketrl.io import write_json, write_jsonl
from snaketrl.report import intervals, leaderboard
from snaketrl.report.render import evaluation_section

DOCS = Path(__file__).resolve().parents[1] / "docs" / "evaluation.md"
SCORE = "rm_judge"
P = 32


def _jobs(root: Path, jobs: dict[str, tuple[str, list[float]]]) -> dict[str, dict]:
    """Eval job files as the evaluate rule writes them: job -> (trainer, its score of each prompt), all on model
    m, each run against base-m. Returns the report's `evaluated`."""
    base = jobs["base-m"][1]
    evaluated = {}
    for i, (job, (trainer, values)) in enumerate(jobs.items()):
        info = {"run": job, "model": "m", "trainer": trainer, "seed": i,
                "reference": None if trainer == "base" else "base-m"}
        rows = [{**info, "prompt_id": p, "prompt": f"prompt {p}", "completion": f"{job} says {p}", "n_tokens": 3,
                 SCORE: v} for p, v in enumerate(values)]
        metrics = {**info, "n_prompts": len(values),
                   "scores": {SCORE: {**mean_std(values), "win_rate": None if trainer == "base" else win_rate(values, base)}}}
        out = {"completions": root / job / "completions.jsonl", "metrics": root / job / "metrics.json"}
        write_jsonl(rows, out["completions"])
        write_json(metrics, out["metrics"])
        evaluated[job] = out
    return evaluated


def _seeds(name: str, trainer: str, matrix) -> dict[str, tuple[str, list[float]]]:
    return {f"{name}-{s + 1}": (trainer, [float(v) for v in row]) for s, row in enumerate(np.atleast_2d(matrix))}


def _groups(jobs) -> dict[str, str]:
    return {job: job.rsplit("-", 1)[0] for job in jobs if job != "base-m"}


def _report(tmp_path, jobs):
    evaluated = _jobs(tmp_path / "evaluation", jobs)
    return evaluated, evaluation_section(evaluated, _groups(jobs), {})


def _mark(section, group, col=SCORE):
    table = section["leaderboard"]
    cells = {row[0]["text"] if isinstance(row[0], dict) else row[0]: row for row in table["rows"]}
    return cells[group][[c["name"] for c in table["columns"]].index(col)]


def _snippet(db: Path, first: str, second: str) -> tuple[float, float, float]:
    """docs/evaluation.md's recomputation, run on `db`: (difference, low, high) as it prints them."""
    code = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S).group(1)
    code = code.replace('"results/evaluation.sqlite"', repr(str(db)))
    code = code.replace('"rm_reward_pythia_tiny", "dpo-qwen2-tiny", "sft-qwen2-tiny"', f"{SCORE!r}, {first!r}, {second!r}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOCS), "exec"), {})
    numbers = re.findall(r"-?\d+\.\d+(?:e-?\d+)?", out.getvalue())
    return tuple(float(n) for n in numbers)


def test_the_interval_recomputed_from_the_sqlite_is_the_reports(tmp_path):
    rng = np.random.default_rng(7)
    prompt = rng.normal(0, 1, P)
    jobs = {"base-m": ("base", list(prompt)),
            **_seeds("a", "sft", prompt + 0.4 + rng.normal(0, 0.3, (3, P))),
            **_seeds("b", "dpo", prompt + rng.normal(0, 0.3, (3, P)))}
    evaluated, section = _report(tmp_path, jobs)
    lead = section["best"][SCORE]
    d = lead["difference"]
    assert (lead["group"], lead["runner_up"], d.seeds, d.prompts) == ("a", "b", (3, 3), P)
    assert d.difference == pytest.approx(np.mean(jobs["a-1"][1] + jobs["a-2"][1] + jobs["a-3"][1])
                                         - np.mean(jobs["b-1"][1] + jobs["b-2"][1] + jobs["b-3"][1]), rel=1e-12)
    db = tmp_path / "evaluation.sqlite"
    collect([f["completions"] for f in evaluated.values()], db, metrics_files=[f["metrics"] for f in evaluated.values()],
            groups=_groups(jobs))
    # By hand, as docs/evaluation.md says: numpy and scipy on the database, nothing of snaketrl.
    assert _snippet(db, "a", "b") == pytest.approx((d.difference, d.low, d.high), rel=1e-12)
    # Every column's interval, the win rates' too, from the database's rows alone.
    with sqlite3.connect(db) as con:
        cur = con.execute("SELECT * FROM completions")
        rows = [dict(zip([c[0] for c in cur.description], r)) for r in cur]
        groups = dict(con.execute("SELECT run, run_group FROM run_groups"))
    scores = intervals.prompt_scores(rows, groups)
    # The per-prompt values are what the leaderboard's cells are the means of, win rates included.
    means = scores.groupby("group")[[SCORE, f"{SCORE} win"]].mean()
    board = section["board"]["mean"]
    assert np.allclose(means.loc[["a", "b"]].to_numpy(), board.loc[["a", "b"], [SCORE, f"{SCORE} win"]].to_numpy())
    for col in (SCORE, f"{SCORE} win"):
        best = section["best"][col]
        assert intervals.compare(scores, best["group"], best["runner_up"], col) == best["difference"]
    # The report says the same numbers: the leaderboard's tooltip and the sentence under the figure.
    cell = _mark(section, "a")
    assert (cell["mark"], cell["bold"]) == ("★", True) and d.low > 0
    text = intervals.describe(d, "float", 3)
    assert cell["title"] == f"{text} over b: a lead"
    assert "best is a (" in section["first"]["sentences"][1] and f"{text} against b: a lead" in \
        section["first"]["sentences"][1]


def test_a_planted_tie_never_gets_a_star(tmp_path):
    rng = np.random.default_rng(3)
    prompt = rng.normal(0, 1, P)
    seeds = prompt + rng.normal(0, 0.3, (3, P))
    # One recipe run twice with the same seeds: the same scores, listed in another order of seeds.
    jobs = {"base-m": ("base", list(prompt)), **_seeds("a", "sft", seeds), **_seeds("b", "sft", seeds[::-1])}
    _, section = _report(tmp_path / "same", jobs)
    assert SCORE not in section["best"] and not any(c.get("mark") == "★" for r in section["leaderboard"]["rows"]
                                                     for c in r if isinstance(c, dict))
    d = intervals.paired(pd.DataFrame(seeds), pd.DataFrame(seeds[::-1]))
    assert intervals.tied(d.difference, 0) and d.low <= 0 <= d.high and d.needed is None
    assert intervals.needed(d) == "no difference observed, so no number of seeds would show one"
    # One seed each, differing only in seed: a seed shifts every prompt's score, so the prompts' interval
    # excludes zero; with one seed that can be the seed alone, and no ★.
    jobs = {"base-m": ("base", list(prompt)), **_seeds("a", "sft", prompt + 0.3 + rng.normal(0, 0.1, P)),
            **_seeds("b", "sft", prompt + rng.normal(0, 0.1, P))}
    _, section = _report(tmp_path / "seeded", jobs)
    lead = section["best"][SCORE]
    assert lead["difference"].low > 0 and lead["settled"] is False and _mark(section, "a")["mark"] == "≈"
    assert "with one seed a run's difference from another can be its seed's alone" in _mark(section, "a")["title"]


def test_planted_ties_over_seeds_get_a_star_at_most_as_often_as_a_95_percent_interval_allows():
    # Two runs of one recipe, 3 seeds each: per prompt, the prompt's own effect, a shift per seed (as a
    # training seed moves every score) and noise. A 95 % interval gives a false lead in about 5 % of them.
    rng = np.random.default_rng(2026)
    stars = 0
    for _ in range(200):
        prompt = rng.normal(0, 1, P)
        a, b = (pd.DataFrame(prompt + rng.normal(0, 0.3, (3, 1)) + rng.normal(0, 0.5, (3, P))) for _ in "ab")
        d = intervals.paired(a, b)
        stars += leaderboard.settled(d, d.difference > 0)
    assert stars <= 10, f"{stars} of 200 planted ties got a ★"


def test_a_planted_clear_difference_is_a_lead(tmp_path):
    # 1 against 0 on 28 of 32 prompts (each seed of a misses one of them), both 0 on the rest.
    a = np.zeros((3, P))
    a[:, :28] = 1
    for s in range(3):
        a[s, s] = 0
    jobs = {"base-m": ("base", [0.0] * P), **_seeds("a", "grpo", a), **_seeds("b", "sft", np.zeros((3, P)))}
    _, section = _report(tmp_path, jobs)
    lead = section["best"][SCORE]
    assert lead["group"] == "a" and lead["settled"] and lead["difference"].low > 0.5
    assert _mark(section, "a")["mark"] == "★"
    sentence = section["first"]["sentences"][1]
    assert re.search(r"best is a \(0\.844 ± 0\.000\), \+0\.844 \(95 % interval \+0\.\d{3} to \+0\.\d{3}\) against b: a lead",
                     sentence), sentence
    assert re.search(r"; \+0\.844 \(95 % interval \+0\.\d{3} to \+0\.\d{3}\) against its base base-m \(0\.000\): better",
                     sentence), sentence
    # 1 on every prompt against the base's 0: every resample is 1, and so is the interval.
    d = intervals.paired(pd.DataFrame([[1.0] * P]), pd.DataFrame([[0.0] * P]))
    assert (d.difference, d.low, d.high, d.lead) == (1.0, 1.0, 1.0, True)


def test_a_tie_says_how_many_seeds_or_prompts_would_settle_it(tmp_path):
    rng = np.random.default_rng(11)
    prompt = rng.normal(0, 1, P)
    a = prompt + 0.05 + rng.normal(0, 0.4, (3, 1)) + rng.normal(0, 0.3, (3, P))
    b = prompt + rng.normal(0, 0.4, (3, 1)) + rng.normal(0, 0.3, (3, P))
    jobs = {"base-m": ("base", list(prompt)), **_seeds("a", "sft", a), **_seeds("b", "dpo", b)}
    _, section = _report(tmp_path / "seeds", jobs)
    lead = section["best"][SCORE]
    d = lead["difference"]
    assert lead["settled"] is False and d.low < 0 < d.high and d.unit == "seeds"
    # n ≈ (z_0.975 + z_0.8)² σ² / δ², σ² the two runs' variances of one seed's mean.
    delta = abs(a.mean() - b.mean())
    sigma2 = a.mean(axis=1).var(ddof=1) + b.mean(axis=1).var(ddof=1)
    n = math.ceil((1.959963984540054 + 0.8416212335729143) ** 2 * sigma2 / delta ** 2)
    assert d.needed == n > 3
    top, second = lead["group"], lead["runner_up"]
    assert f"Leads not settled (≈ in the leaderboard): {SCORE}: {top} ≈ {second} (a difference this size would need " \
           f"about {n} seeds per run (has 3))" in section["first"]["sentences"][2]
    # With one seed: prompts, σ the per-prompt differences' std.
    a, b = prompt + 0.05 + rng.normal(0, 0.3, P), prompt + rng.normal(0, 0.3, P)
    jobs = {"base-m": ("base", list(prompt)), **_seeds("a", "sft", a), **_seeds("b", "dpo", b)}
    _, section = _report(tmp_path / "one", jobs)
    d = section["best"][SCORE]["difference"]
    diff = (a - b) if section["best"][SCORE]["group"] == "a" else (b - a)
    n = math.ceil((1.959963984540054 + 0.8416212335729143) ** 2 * diff.var(ddof=1) / diff.mean() ** 2)
    assert d.low < 0 < d.high and (d.unit, d.needed) == ("prompts", n)
    assert f"a difference this size would need about {n:,} prompts (has {P})" in section["first"]["sentences"][1]


def test_a_bound_at_float_noise_above_zero_is_written_with_its_sign():
    # A paired bound of 1e-17 (equal scores summed in another order) shows as "<0.001"; it once crashed the report.
    assert intervals.signed(1e-17, "float", 3) == "+<0.001"
    assert intervals.signed(-1e-17, "float", 3) == "−<0.001"
    assert intervals.signed(0.0, "float", 3) == "0.000"
    assert intervals.signed(-0.5, "percent", None) == "−50.0"


def test_a_tie_that_has_the_prompts_it_would_need_asks_for_seeds():
    # ppo (one seed) ≈ grpo (two): the power rule's 18 prompts are there (160), so prompts are not what is missing.
    tie = intervals.Difference(difference=0.1, low=-0.1, high=0.3, prompts=160, seeds=(1, 2), needed=18,
                               unit="prompts")
    assert intervals.needed(tie) == ("with one seed a run's difference from another can be its seed's alone: "
                                     "set seeds: [1, 2, 3]")
    # The other run has 2 seeds, so the config's seeds already are several: the one-seed run's own entry is named
    # (config/smollm2.yaml: seeds [1, 2, 3], runs.ppo-smollm2.seeds [1]).
    assert intervals.needed(tie, ("ppo-smollm2", "grpo-smollm2")).endswith(": set runs.ppo-smollm2.seeds: [1, 2, 3]")
    assert intervals.needed(tie, ("grpo-smollm2", "ppo-smollm2")).endswith(": set runs.grpo-smollm2.seeds: [1, 2, 3]")
    both = intervals.Difference(difference=0.1, low=-0.1, high=0.3, prompts=160, seeds=(1, 1), needed=18,
                                unit="prompts")
    assert intervals.needed(both, ("ppo-smollm2", "grpo-smollm2")).endswith(": set seeds: [1, 2, 3]")
    short = intervals.Difference(difference=0.1, low=-0.1, high=0.3, prompts=16, seeds=(1, 2), needed=18,
                                 unit="prompts")
    assert intervals.needed(short) == "a difference this size would need about 18 prompts (has 16)"


def test_a_tie_whose_seeds_meet_the_power_rule_asks_for_what_is_short():
    # GRPO − its SFT start over 3 seeds and 128 prompts (docs/real-model.md's sixth try): +0.065, interval across
    # zero, while the seeds' spread alone asked for 2 seeds: "would need about 2 seeds (has 3)" read as settled.
    def tie(needed_prompts, prompts=128):
        return intervals.Difference(difference=0.065, low=-0.028, high=0.152, prompts=prompts, seeds=(3, 3),
                                    needed=2, unit="seeds", needed_prompts=needed_prompts)
    assert intervals.needed(tie(95, prompts=64)) == "a difference this size would need about 95 prompts (has 64)"
    assert intervals.needed(tie(95)) == (
        "not settled with 3 seeds per run and 128 prompts, though the power rule asks about 2 and 95 for a "
        "difference this size taken one at a time: more seeds would narrow it")
    short = intervals.Difference(difference=0.065, low=-0.028, high=0.152, prompts=128, seeds=(3, 3), needed=12,
                                 unit="seeds", needed_prompts=95)
    assert intervals.needed(short) == "a difference this size would need about 12 seeds per run (has 3)"
