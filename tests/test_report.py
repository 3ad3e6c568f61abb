import json
import re

import pandas as pd

from snaketrl.plots import plot_run
from snaketrl.report import render, summary_table
from test_plots import DPO_STATE

RUNS = {"dpo-a": {"trainer": "dpo", "model": "a", "dataset": "uf", "args": {}},
        "dpo-b": {"trainer": "dpo", "model": "b", "dataset": "uf", "args": {}}}


def _fake_results(root):
    for run, spec in RUNS.items():
        d = root / "runs" / run
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps(DPO_STATE))
        (d / "manifest.json").write_text(json.dumps({"config": {"run": run, "seed": 1}, "trl_args": {"beta": 0.1},
                                                     "versions": {"trl": "1.12.0"}}))
        plot_run(d / "trainer_state.json", d / "curves.png", d / "log_history.csv", run)
        lengths = root / "lengths" / "dpo" / "uf" / f"{spec['model']}.json"
        lengths.parent.mkdir(parents=True, exist_ok=True)
        lengths.write_text(json.dumps({"max_length": 96, "share_truncated": 0.02, "padding_share": 0.3}))
        lengths.with_suffix(".png").write_bytes((d / "curves.png").read_bytes())
        bench = root / "benchmarks" / "train" / f"{run}.tsv"
        bench.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame({"s": [3.0], "max_rss": [512.0]}).to_csv(bench, sep="\t", index=False)


def test_report_is_self_contained_and_lists_every_run(tmp_path):
    _fake_results(tmp_path)
    html = render(runs=RUNS, results=tmp_path, out=tmp_path / "report.html")
    assert (tmp_path / "report.html").read_text() == html
    table = summary_table(RUNS, tmp_path).reset_index()
    assert table["run"].tolist() == ["dpo-a", "dpo-b"]
    assert all(f"<th>{run}</th>" in html for run in RUNS)
    assert table["max_length"].tolist() == [96, 96]
    assert table["steps"].tolist() == [4, 4]
    assert table["eval loss"].tolist() == [0.6, 0.6]
    assert table["train loss (last log)"].tolist() == [0.5, 0.5]
    assert table["headline (first → last log)"].tolist() == ["rewards/margins 0 → 0.4"] * 2
    assert table["peak RSS (MB)"].tolist() == [512, 512]
    # 2 runs x (curves + histogram) + 1 overlay for the one trainer; nothing loaded from elsewhere.
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 5
    assert not re.search(r'src="(?!data:)', html)
    assert "&#34;beta&#34;: 0.1" in html or '"beta": 0.1' in html
