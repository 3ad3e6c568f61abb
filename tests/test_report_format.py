"""Numbers as a person reads them, the ★/tie/base rules of the leaderboard, and runs that did not move."""

import json
import re

import pytest

from snaketrl.report import glance, leaderboard
from snaketrl.report.format import column, decimals_for, number, plain, pretty_json, table

E_NOTATION = re.compile(r"\d(\.\d+)?[eE][+-]?\d")


@pytest.mark.parametrize("value, kind, text", [
    (5e-3, "float", "0.005"), (5e-05, "float", "0.00005"), (0.25831, "float", "0.2583"), (12345.6, "float", "12,346"),
    (12345, "int", "12,345"), (1.2e4, "int", "12,000"), (0.625, "percent", "62.5%"), (1, "percent", "100.0%"),
    (3.2e12, "si", "3.20 T"), (45_600, "si", "45.6 k"), (999, "si", "999"), (2.5 * 2**30, "bytes", "2.50 GiB"),
    (512 * 2**20, "bytes", "512 MiB"), (75.25, "seconds", "75.2 s"), (1234.5, "seconds", "20 min 34 s"),
    (None, "float", "–"), (float("nan"), "percent", "–"), (True, "text", "yes"), ("<b>", "text", "<b>"),
])
def test_number_reads_without_e_notation(value, kind, text):
    assert number(value, kind) == text


@pytest.mark.parametrize("value, kind, decimals, text", [
    (-2.85, "float", 2, "−2.85"), (-12345.6, "float", None, "−12,346"), (-0.005, "float", None, "−0.005"),
    (-3, "int", None, "−3"), (-0.125, "percent", None, "−12.5%"), (-3.2e12, "si", None, "−3.20 T"),
    (float("-inf"), "float", None, "−∞"), (-1e-17, "float", 3, "−<0.001"), (-0.0001, "float", 2, "−<0.01"),
    (-0.0, "float", 3, "0.000"), (-0.4, "int", None, "0"), (2.85, "float", 2, "2.85"),
])
def test_a_negative_number_reads_with_the_minus_sign_its_differences_have(value, kind, decimals, text):
    # One sign rule for the page: a value and a difference ("−0.120 (95 % interval ...)") write the same minus;
    # a number that shows as zero has no sign.
    assert number(value, kind, decimals) == text


def test_no_e_notation_at_any_magnitude():
    for exponent in range(-12, 19):
        for value in (1.5 * 10.0 ** exponent, -(10.0 ** exponent)):
            for kind in ("float", "si", "percent", "int"):
                assert not E_NOTATION.search(number(value, kind)), (value, kind, number(value, kind))
            assert not E_NOTATION.search(plain(value)) and float(plain(value)) == value


def test_json_of_a_config_keeps_every_digit_in_positional_notation():
    text = pretty_json({"learning_rate": 5e-05, "adam_epsilon": 1e-08, "big": 1.5e20, "x": [0.1, float("nan")]})
    assert '"learning_rate": 0.00005' in text and '"adam_epsilon": 0.00000001' in text
    assert '"big": 150000000000000000000' in text and "NaN" in text and not E_NOTATION.search(text)


def test_a_float_column_has_one_number_of_decimals():
    assert decimals_for([0.258, -0.1]) == 3 and decimals_for([5.4, 12.1]) == 1 and decimals_for([123.4]) == 0
    t = table([column("run"), column("score", "float"), column("win", "percent", secondary=True)],
              [["a", 0.5, 0.5], ["b", 12.25, None]])
    assert [[c["text"] for c in row] for row in t["rows"]] == [["a", "0.5", "50.0%"], ["b", "12.2", "–"]]
    assert [c["sort"] for c in t["rows"][1]] == ["b", 12.25, ""] and t["folded"]


def _job(trainer, model, score, nll=2.0, n=8):
    return {"trainer": trainer, "model": model, "n_prompts": n, "references": {"nll": nll},
            "scores": {"rm_judge": {"mean": score, "std": 0.4, "win_rate": 0.5}}}


def test_base_is_the_reference_never_starred_and_a_tie_is_no_lead():
    # The base is best and all runs tie on the score: no star; NLL: a real lead of one run.
    metrics = {"base-m": _job("base", "m", 0.9, nll=3.0), "sft-m": _job("sft", "m", 0.1, nll=1.0),
               "dpo-m": _job("dpo", "m", 0.1, nll=2.0)}
    board, best = leaderboard.table(metrics, {})
    assert "rm_judge" not in best and "rm_judge win" not in best
    # NLL has no per-prompt values: the best is bold, and no lead is called (snaketrl.report.intervals).
    assert best["NLL"] == {"group": "sft-m", "runner_up": "dpo-m", "lead": 1.0, "difference": None, "settled": None}
    rows = {row[0]["text"]: row for row in leaderboard.to_table(board, best)["rows"]}
    assert not any(c["mark"] or c["bold"] for c in rows["base-m"])
    nll = [c for c in rows["sft-m"] if c["bold"]]
    assert [(c["text"], c["mark"]) for c in nll] == [("1.00", "")]
    assert nll[0]["title"] == "ahead of dpo-m; no per-prompt values, so no interval: not called a lead"


def _completions(*texts):
    return [{"prompt_id": i, "completion": t} for i, t in enumerate(texts)]


def test_runs_whose_every_completion_is_their_start_models_did_not_move():
    metrics = {"base-m": {"trainer": "base"}, "sft-m": {"trainer": "sft", "reference": "base-m"},
               "grpo-m": {"trainer": "grpo", "reference": "base-m"}, "dpo-m": {"trainer": "dpo", "reference": "base-m"}}
    runs = {"grpo-m": {"policy": "sft-m"}, "sft-m": {}, "dpo-m": {}}
    starts = glance.start_jobs(metrics, runs)
    assert starts == {"sft-m": "base-m", "grpo-m": "sft-m", "dpo-m": "base-m"}  # GRPO starts from the SFT policy
    # GRPO writes the SFT policy's completions prompt for prompt (listed in another order), DPO the base's.
    completions = {"base-m": _completions("a", "b"), "sft-m": _completions("a", "c"),
                   "grpo-m": _completions("a", "c")[::-1], "dpo-m": _completions("a", "b")}
    same = glance.unmoved(completions, starts)
    assert same == {"grpo-m": "sft-m", "dpo-m": "base-m"}
    assert glance.moved_groups({}, starts, same) == {"sft-m": None, "grpo-m": "sft-m", "dpo-m": "base-m"}
    # A group moved unless every seed is its start's.
    seeds = {"dpo-1": "dpo", "dpo-2": "dpo"}
    assert glance.moved_groups(seeds, {"dpo-1": "base-m", "dpo-2": "base-m"}, {"dpo-1": "base-m"}) == {"dpo": None}


def test_the_sentence_names_the_best_per_model_and_the_runs_that_did_not_move():
    metrics = {"base-m": _job("base", "m", 0.1), "sft-m": _job("sft", "m", 0.5), "dpo-m": _job("dpo", "m", 0.3),
               "grpo-m": _job("grpo", "m", 0.5 + 1e-15)}
    board, best = leaderboard.table(metrics, {})
    text = glance.sentences(board, "rm_judge", True, {"sft-m": None, "dpo-m": "base-m", "grpo-m": None}, 8, best)
    assert text[0] == "Yardstick: rm_judge, higher is better; one seed per run. Bars: the 95 % interval of a run's " \
                      "paired difference to its base (bootstrap over the 8 prompts); a bar that crosses its base's " \
                      "line is no difference from it."
    assert "m: no run leads; " in text[1] and "tie at 0.500" in text[1] and "better than its base base-m (0.100)" in text[1]
    assert best == {}  # every column ties at the top: nothing to say about leads
    assert text[2].startswith("With one seed per run the intervals cover the prompts only")
    assert text[3] == "Did not move from their start model (the same completion for every prompt): dpo-m (= base-m)."


def test_the_yardstick_sentence_says_runs_have_different_seeds_where_they_do():
    # config/smollm2.yaml: SFT over 3 seeds, DPO over 1; "the mean over 3 seeds" was said of both.
    metrics = {"base-m": _job("base", "m", 0.1), "dpo-m": _job("dpo", "m", 0.3),
               **{f"sft-m-seed{s}": _job("sft", "m", 0.5 + s / 100) for s in (1, 2, 3)}}
    board, best = leaderboard.table(metrics, {f"sft-m-seed{s}": "sft-m" for s in (1, 2, 3)})
    text = glance.sentences(board, "rm_judge", True, {}, 8, best)
    assert text[0].startswith("Yardstick: rm_judge, higher is better; each value the mean over a run's seeds (1 to 3) "
                              "± their std where it has several. Bars:")
    metrics.pop("dpo-m")
    board, best = leaderboard.table(metrics, {f"sft-m-seed{s}": "sft-m" for s in (1, 2, 3)})
    assert glance.sentences(board, "rm_judge", True, {}, 8, best)[0].startswith(
        "Yardstick: rm_judge, higher is better; each value the mean over 3 seeds ± their std. Bars:")


def test_the_sentence_writes_a_negative_yardstick_with_the_minus_sign_of_its_intervals():
    # A negative score (an NLL-like reward) once read "base-m (-2.85)" beside "−0.120 (95 % interval ...)".
    metrics = {"base-m": _job("base", "m", -2.85), "sft-m": _job("sft", "m", -0.5), "dpo-m": _job("dpo", "m", -1.25)}
    board, best = leaderboard.table(metrics, {})
    text = glance.sentences(board, "rm_judge", True, {}, 8, best)
    assert "m: best is sft-m (−0.50), ahead of dpo-m (no per-prompt values" in text[1]
    assert "better than its base base-m (−2.85)" in text[1]
    rows = {row[0]["text"]: [c["text"] for c in row] for row in leaderboard.to_table(board, best)["rows"]}
    assert "−2.85" in rows["base-m"] and "−1.25" in rows["dpo-m"]
    assert not re.search(r"-\d", " ".join(text) + " ".join(sum(rows.values(), [])))


def test_names_from_the_config_are_escaped(tmp_path, monkeypatch):
    import test_report

    from snaketrl.report.render import render

    runs = {"dpo-<i>x</i>": {"trainer": "dpo", "model": "<b>m</b>", "dataset": "uf", "args": {"lr": 5e-05}}}
    monkeypatch.setattr(test_report, "RUNS", runs)
    files = test_report._fake_results(tmp_path)
    evaluated = {}
    for i, (name, m) in enumerate({"base-<b>m</b>": _job("base", "<b>m</b>", 0.1),
                                   "dpo-<i>x</i>": _job("dpo", "<b>m</b>", 0.2)}.items()):
        (tmp_path / f"{i}.json").write_text(json.dumps({**m, "reference": "base-<b>m</b>"}))
        completion = "line 1\nline 2" if "dpo" in name else ""  # the base generated nothing
        (tmp_path / f"{i}.jsonl").write_text(json.dumps({"prompt_id": 0, "prompt": "p", "completion": completion}))
        evaluated[name] = {"metrics": tmp_path / f"{i}.json", "completions": tmp_path / f"{i}.jsonl"}
    html = render(runs=runs, files=files, out=tmp_path / "report.html", evaluated=evaluated,
                  groups={n: n for n in evaluated})
    assert "<i>x</i>" not in html and "<b>m</b>" not in html and "dpo-&lt;i&gt;x&lt;/i&gt;" in html
    assert "line 1\nline 2" in html and ">(empty)<" in html and "\\n" not in html.split("<script>")[0]


def test_a_manifest_with_numerics_shows_them_in_its_run_and_one_without_still_renders(tmp_path):
    import test_report

    from snaketrl.report.render import render

    files = test_report._fake_results(tmp_path)
    manifest = json.loads(files["dpo-a"]["manifests"].read_text())
    manifest["numerics"] = {"cpu_capability": "avx2", "dnnl_max_cpu_isa": None, "threads": 2,
                            "device": "AMD EPYC 7763", "dtype": "float32"}
    files["dpo-a"]["manifests"].write_text(json.dumps(manifest))
    html = render(runs=test_report.RUNS, files=files, out=tmp_path / "report.html")
    line = "numerics: cpu_capability avx2, dnnl_max_cpu_isa –, threads 2, device AMD EPYC 7763, dtype float32"
    run_a, run_b = html[html.index('id="dpo-a"'):html.index('id="dpo-b"')], html[html.index('id="dpo-b"'):]
    assert line in run_a and "numerics:" not in run_b


def test_figure_rows_are_trainer_and_dataset_unless_a_model_has_two_groups_there():
    metrics = {"base-m": _job("base", "m", 0.1), "sft-m": _job("sft", "m", 0.5), "sft-n": _job("sft", "n", 0.5),
               "dpo-m-b1": _job("dpo", "m", 0.3), "dpo-m-b2": _job("dpo", "m", 0.4)}
    board, _ = leaderboard.table(metrics, {})
    labels = glance.row_labels(board, {"sft-m": "tldr", "sft-n": "tldr", "dpo-m-b1": "uf", "dpo-m-b2": "uf"})
    assert labels == {"sft-m": "sft · tldr", "sft-n": "sft · tldr", "dpo-m-b1": "dpo-m-b1", "dpo-m-b2": "dpo-m-b2"}
    png = glance.glance_png(board, "rm_judge", True, {}, {"dpo-m-b1": "base-m"})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
