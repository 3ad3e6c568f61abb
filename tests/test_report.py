import json
import re

import pandas as pd
from test_plots import DPO_STATE

from snaketrl.report.plots import plot_run
from snaketrl.report.render import load_runs, render, summary_table

RUNS = {"dpo-a": {"trainer": "dpo", "model": "a", "dataset": "uf", "args": {}},
        "dpo-b": {"trainer": "dpo", "model": "b", "dataset": "uf", "args": {}}}


def _fake_results(root):
    """Each run's files, laid out anywhere: the report reads only what it is given."""
    files = {}
    for run, spec in RUNS.items():
        d = root / "somewhere" / run
        d.mkdir(parents=True)
        f = {key: d / name for key, name in (
            ("states", "state.json"), ("manifests", "manifest.json"), ("curves", "curves.png"),
            ("lengths", "lengths.json"), ("histograms", "hist.png"), ("benchmarks", "bench.tsv"),
            ("summaries", "data.json"), ("metrics", "metrics.json"))}
        f["states"].write_text(json.dumps(DPO_STATE))
        f["manifests"].write_text(json.dumps({"config": {"run": run, "seed": 1}, "trl_args": {"beta": 0.1},
                                              "versions": {"trl": "1.12.0"}}))
        plot_run(f["states"], f["curves"], d / "log_history.csv", run)
        f["lengths"].write_text(json.dumps({"max_length": 96, "share_truncated": 0.02, "padding_share": 0.3, "dropped": 0,
                                            "batching": {"strategy": "grouped", "requested": "auto", "args": {},
                                                         "reason": "why", "expected_efficiency": 0.9,
                                                         "padding_efficiency": 0.7}}))
        # dpo-b ran in the fork server (snaketrl.forkserver): its benchmark measured the waiting process only.
        f["metrics"].write_text(json.dumps({"token_efficiency": 0.88, "real_tokens_per_second": 1234.5,
                                            "peak_rss_bytes": (700 if run == "dpo-b" else 300) * 2**20}))
        f["histograms"].write_bytes(f["curves"].read_bytes())
        pd.DataFrame({"s": [3.0], "max_rss": [512.0]}).to_csv(f["benchmarks"], sep="\t", index=False)
        f["summaries"].write_text(json.dumps({"train": {"rows": 10, "dropped": 2 if run == "dpo-b" else 0},
                                              "eval": {"rows": 2, "dropped": 1}}))
        files[run] = f
    return files


def test_report_is_self_contained_and_lists_every_run(tmp_path):
    files = _fake_results(tmp_path)
    html = render(runs=RUNS, files=files, out=tmp_path / "report.html")
    assert (tmp_path / "report.html").read_text() == html
    table = summary_table(RUNS, load_runs(files)).reset_index()
    assert table["run"].tolist() == ["dpo-a", "dpo-b"]
    assert table["rows dropped"].tolist() == [1, 3]
    assert all(f"<th>{run}</th>" in html for run in RUNS)
    assert table["max_length"].tolist() == [96, 96]
    assert table["steps"].tolist() == [4, 4]
    assert table["eval loss"].tolist() == [0.6, 0.6]
    assert table["train loss (last log)"].tolist() == [0.5, 0.5]
    assert table["headline (first → last log)"].tolist() == ["rewards/margins 0 → 0.4"] * 2
    assert table["peak RSS (MB)"].tolist() == [512, 700]  # the larger of Snakemake's and the job's own
    assert table["batching"].tolist() == ["grouped"] * 2
    assert table["expected efficiency"].tolist() == [0.9, 0.9] and table["token efficiency"].tolist() == [0.88, 0.88]
    assert "<b>88.0%</b> real tokens,\n1,234 real tokens/s" in html
    # 2 runs x (curves + histogram) + 1 overlay for the one trainer; nothing loaded from elsewhere.
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 5
    assert not re.search(r'src="(?!data:)', html)
    assert "&#34;beta&#34;: 0.1" in html or '"beta": 0.1' in html


def test_a_diverged_run_is_listed_as_such_and_not_ranked():
    from snaketrl.report import leaderboard

    def job(nll, acc):
        return {"trainer": "sft", "model": "m", "references": {"nll": nll}, "pairs": {"accuracy": acc}}

    metrics = {"a-s1": job(2.0, 0.5), "a-s2": job(2.2, 0.7), "b-s1": job(1.0, 0.9), "b-s2": job(float("nan"), 0.0),
               "c-s1": job(3.0, 0.55)}
    board, best = leaderboard.table(metrics, {job: job.split("-")[0] for job in metrics})
    # b's finite seed alone would lead both columns; with a diverged seed it ranks nowhere.
    assert best["NLL"]["group"] == "a" and best["pref. acc."]["group"] == "a"
    assert board["mean"]["NLL"].isna().tolist() == [False, True, False]
    assert board["info"]["diverged"].tolist() == [0, 1, 0]
    rows = {row[0]["text"]: [c["text"] for c in row] for row in leaderboard.to_table(board, best)["rows"]}
    assert rows["b"][3] == "2 (1 diverged)" and rows["b"].count("diverged") == 2
    assert not any("nan" in text.lower() for row in rows.values() for text in row)


def test_a_non_finite_headline_reads_diverged_in_the_summary():
    from snaketrl.report.render import summarize

    state = json.loads(json.dumps(DPO_STATE))
    state["log_history"][2]["rewards/margins"] = float("nan")
    lengths = {"max_length": 96, "share_truncated": 0.0}
    row = summarize("dpo-a", RUNS["dpo-a"], state, lengths, None)
    assert row["headline (first → last log)"] == "rewards/margins 0 → diverged"
