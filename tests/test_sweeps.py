"""Hyperparameter sweeps: expansion at parse time, errors, the dry run's job counts, the report section."""

import copy
import json
import struct

import pytest

from conftest import ROOT
from snaketrl.config import ConfigError, resolve_runs, validate
from snaketrl.config.evaluation import check_evaluation

SCHEMA = str(ROOT / "config" / "schema.yaml")
ISSUE = {"dpo": {"beta": [0.05, 0.1, 0.5], "learning_rate": [1.0e-5, 5.0e-5]}}
MODELS = ("qwen2-tiny", "pythia-tiny")


def swept(config, sweeps, **top):
    config = copy.deepcopy(config)
    config.update(sweeps=copy.deepcopy(sweeps), **top)
    validate(config, SCHEMA)
    return config


def test_each_run_becomes_one_run_per_combination_named_by_its_values(config):
    runs = resolve_runs(swept(config, ISSUE))
    dpo = sorted(n for n in runs if n.startswith("dpo-qwen2-tiny"))
    assert dpo == [f"dpo-qwen2-tiny-beta~{b}_learning_rate~{lr}" for b in ("0.05", "0.1", "0.5")
                   for lr in ("1e-05", "5e-05")]
    assert "dpo-qwen2-tiny" not in runs and len([n for n in runs if n.startswith("dpo-")]) == 12
    run = runs["dpo-qwen2-tiny-beta~0.5_learning_rate~1e-05"]
    # Swept values beat the trainer's args (beta 0.1) and `training` (learning_rate 5e-3); the rest is kept.
    assert run["args"] == {**config["training"], **config["trainers"]["dpo"]["args"], "beta": 0.5, "learning_rate": 1e-05}
    assert (run["sweep"], run["swept"], run["group"]) == ("dpo-qwen2-tiny", {"beta": 0.5, "learning_rate": 1e-05},
                                                          "dpo-qwen2-tiny-beta~0.5_learning_rate~1e-05")
    # Runs of other trainers are untouched, to the byte: their jobs do not rerun.
    assert repr(runs["sft-qwen2-tiny"]) == repr(resolve_runs(config)["sft-qwen2-tiny"])


def test_names_do_not_depend_on_key_order_and_survive_an_added_value(config):
    before = resolve_runs(swept(config, ISSUE))
    reordered = {"dpo": dict(reversed(list(ISSUE["dpo"].items())))}
    assert repr(resolve_runs(swept(config, reordered))) == repr(before)
    more = copy.deepcopy(ISSUE)
    more["dpo"]["beta"].append(1)
    after = resolve_runs(swept(config, more))
    assert set(after) - set(before) == {f"dpo-{m}-beta~1_learning_rate~{lr}" for m in MODELS
                                        for lr in ("1e-05", "5e-05")}
    assert all(repr(after[n]) == repr(run) for n, run in before.items())
    assert after["dpo-qwen2-tiny-beta~1_learning_rate~1e-05"]["args"]["beta"] == 1  # an int stays an int


def test_sweep_composes_with_seeds(config):
    runs = resolve_runs(swept(config, {"dpo": {"beta": [0.05, 0.5]}}, seeds=[1, 2]))
    name = "dpo-qwen2-tiny-beta~0.05"
    assert {n: (r["seed"], r["group"]) for n, r in runs.items() if n.startswith(name)} == {
        f"{name}-seed1": (1, name), f"{name}-seed2": (2, name)}


def test_references_keep_the_unswept_run(config):
    config = swept(config, {"sft": {"learning_rate": [1e-3, 1e-2]}, "reward": {"learning_rate": [1e-3]}},
                   seeds=[7])
    runs = resolve_runs(config)
    # PPO and GRPO start from SFT and PPO is judged by the reward run: those stay, with their own settings.
    assert runs["ppo-qwen2-tiny-seed7"]["policy"] == "sft-qwen2-tiny-seed7"
    assert runs["ppo-qwen2-tiny-seed7"]["reward_model"] == "reward-qwen2-tiny-seed7"
    assert runs["sft-qwen2-tiny-seed7"]["args"]["learning_rate"] == config["training"]["learning_rate"]
    assert "sweep" not in runs["sft-qwen2-tiny-seed7"]
    assert runs["sft-qwen2-tiny-learning_rate~0.01-seed7"]["args"]["learning_rate"] == 0.01
    assert "reward-pythia-tiny-learning_rate~0.001-seed7" in runs
    ev = check_evaluation(config["evaluation"], runs, config["datasets"])
    assert ev["reward_models"] == ["reward-qwen2-tiny-seed7", "reward-pythia-tiny-seed7"]


def test_a_reference_may_name_one_combination(config):
    for trainer in ("grpo", "ppo"):
        config["trainers"][trainer]["policy"] = "sft-{model}-learning_rate~0.01"
    runs = resolve_runs(swept(config, {"sft": {"learning_rate": [1e-3, 1e-2]}}))
    assert runs["grpo-pythia-tiny"]["policy"] == "sft-pythia-tiny-learning_rate~0.01"
    assert "sft-pythia-tiny" not in runs  # nothing names it any more: it is swept like any other run


def test_evaluation_runs_may_name_a_swept_run(config):
    config = swept(config, ISSUE)
    runs = resolve_runs(config)
    ev = check_evaluation({**config["evaluation"], "runs": ["dpo-pythia-tiny"]}, runs, config["datasets"])
    assert ev["runs"] == sorted(n for n in runs if n.startswith("dpo-pythia-tiny-"))
    assert len(ev["runs"]) == 6


@pytest.mark.parametrize("sweeps, message", [
    ({"dpo": {"bta": [0.1]}}, "config: sweeps.dpo.bta: not a field of trl.DPOConfig; did you mean 'beta'?"),
    ({"ppo": {"klcoef": [0.1]}}, "config: sweeps.ppo.klcoef: not a field of trl.experimental.ppo.PPOConfig; "
                                 "did you mean 'kl_coef'?"),
    ({"sft": {"max_length": [64]}}, "config: sweeps.sft.max_length: set by the length histogram (tune "
                                    "length.keep_share), it cannot be swept"),
    ({"kto": {"beta": [0.1]}}, "config: sweeps.kto: no run trains 'kto' (add it to matrix.trainers or runs)"),
    ({"dpo": {"hub_model_id": ["my run"]}}, "config: sweeps.dpo.hub_model_id: value 'my run' cannot be part of a run name"),
    ({"dpo": {"lr_scheduler_type": ["cosine restarts"]}},
     "config: sweeps.dpo.lr_scheduler_type: expected one of 'linear', 'cosine', 'cosine_with_restarts', "),
    ({"dpo": {"per_device_train_batch_size": [4, 0]}},
     "config: sweeps.dpo.per_device_train_batch_size: expected an integer >= 1, got 0"),
    ({"dpo": {"beta": [0.1, "0.1"]}}, "config: sweeps.dpo: two runs would both be named 'dpo-qwen2-tiny-beta~0.1'"),
    ({"dpo": {"beta": 0.1}}, "config: sweeps.dpo.beta: 0.1 is not of type 'array'"),
    ({"grpo": {"num_generations": [4, 3]}},
     "config: sweeps.grpo (run grpo-qwen2-tiny-num_generations~3): generation batch 16 "),
])
def test_bad_sweep_is_one_line_at_parse_time(config, sweeps, message):
    with pytest.raises(ConfigError) as err:
        resolve_runs(swept(config, sweeps))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_run_that_sets_a_swept_key_itself_is_an_error(config):
    config["runs"]["dpo-qwen2-tiny"] = {"args": {"beta": 0.3}}
    with pytest.raises(ConfigError, match=r"^config: runs.dpo-qwen2-tiny.args.beta: also swept by sweeps.dpo.beta"):
        resolve_runs(swept(config, ISSUE))


def test_dry_run_adds_one_runs_jobs_per_combination_and_model(tmp_path):
    from test_workflow import copy_project, edit_config, snakemake

    wd = copy_project(tmp_path / "wf")

    def counts(sweeps):
        edit_config(wd, lambda c: c.update(sweeps=sweeps))
        proc = snakemake(wd, "-n", "--quiet", "rules", timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        table = proc.stdout[proc.stdout.index("job "):proc.stdout.index("total")]
        return {k: int(v) for k, v in (line.split() for line in table.splitlines()[2:] if line.strip())}

    def diff(a, b):
        return {k: b.get(k, 0) - a.get(k, 0) for k in {*a, *b} if b.get(k, 0) != a.get(k, 0)}

    default = counts({})
    # The issue's sweep: 6 DPO runs per model instead of 1, each trained, plotted and evaluated.
    assert diff(default, counts(ISSUE)) == {"train": 10, "plot_run": 10, "evaluate": 10}
    three = counts({"dpo": {"beta": [0.05, 0.1, 0.5]}})
    four = counts({"dpo": {"beta": [0.05, 0.1, 0.5, 1.0]}})
    one_run = {"train": 1, "plot_run": 1, "evaluate": 1}  # a DPO run's own jobs in the default
    assert diff(three, four) == {k: v * len(MODELS) for k, v in one_run.items()}
    # What the user sees when a swept key is no TRL field: one line, before any job.
    edit_config(wd, lambda c: c.update(sweeps={"dpo": {"bta": [0.1]}}))
    proc = snakemake(wd, "-n", timeout=120)
    assert proc.returncode != 0
    assert "snaketrl: config: sweeps.dpo.bta: not a field of trl.DPOConfig; did you mean 'beta'?\n" in proc.stderr


# --- The report section, from fake evaluation data ------------------------------------------------

def fake_metrics(trainer, model, seed, rm, fn):
    return {"trainer": trainer, "model": model, "seed": seed, "references": {"nll": 3.0},
            "scores": {"rm_judge": {"mean": rm, "std": 0.1, "win_rate": 0.5},
                       "fn_unique_chars": {"mean": fn, "std": 0.1, "win_rate": 0.5}}}


def sweep_runs():
    runs, metrics = {}, {}
    # rm_judge per (beta, lr) and seed: the yardstick, preferred over the reward function's score.
    rm = {(0.1, 0.01): (1.0, 3.0), (0.1, 0.001): (2.0, 2.0), (0.5, 0.01): (4.0, 4.0), (0.5, 0.001): (0.5, 1.5)}
    for (beta, lr), values in rm.items():
        group = f"dpo-a-beta~{beta}_learning_rate~{lr}"
        for seed, value in zip((1, 2), values):
            name = f"{group}-seed{seed}"
            runs[name] = {"trainer": "dpo", "model": "a", "dataset": "uf", "args": {}, "seed": seed, "group": group,
                          "sweep": "dpo-a", "swept": {"beta": beta, "learning_rate": lr}}
            metrics[name] = fake_metrics("dpo", "a", seed, value, 10.0)
    # A reward model sweep is not evaluated: its headline metric from training stands in.
    for lr, acc in ((0.01, 0.75), (0.001, 0.5)):
        name = f"reward-a-learning_rate~{lr}"
        runs[name] = {"trainer": "reward", "model": "a", "dataset": "uf", "args": {}, "seed": 1, "group": name,
                      "sweep": "reward-a", "swept": {"learning_rate": lr}}
    states = {n: {"global_step": 2, "log_history": [{"loss": 0.6, "step": 1}, {"accuracy": 0.5, "step": 1},
                                                    {"accuracy": 0.75 if "0.01" in n else 0.5, "step": 2}]}
              for n in runs}
    return runs, states, metrics


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_sweep_table_and_plot_read_the_yardstick_per_combination():
    import base64

    from snaketrl.report.sweeps import sweep_sections

    runs, states, metrics = sweep_runs()
    dpo, reward = sweep_sections(runs, states, metrics)
    assert (dpo["name"], dpo["metric"], dpo["source"], dpo["combinations"]) == ("dpo-a", "rm_judge", "evaluation", 4)
    rows = [[c["text"] for c in row] for row in dpo["table"]["rows"]]
    assert rows == [
        ["0.1", "0.001", "2.00 ± 0.00", "2"], ["0.1", "0.01", "2.00 ± 1.41", "2"],
        ["0.5", "0.001", "1.00 ± 0.71", "2"], ["0.5", "0.01", "4.00 ± 0.00", "2"]]
    assert [c["bold"] for c in dpo["table"]["rows"][3]] == [False, False, True, False]
    # One panel per swept key, 4 in wide each at 90 dpi.
    assert png_size(base64.b64decode(dpo["png"].split(",", 1)[1]))[0] == 2 * 4 * 90
    assert (reward["metric"], reward["source"]) == ("accuracy", "training log (last value)")
    cells = [c for row in reward["table"]["rows"] for c in row]
    assert "0.750" in {c["text"] for c in cells} and not any(c["bold"] for c in cells)  # no "better" known: no best
    assert png_size(base64.b64decode(reward["png"].split(",", 1)[1]))[0] == 4 * 90


def test_report_renders_the_sweep_section(tmp_path, monkeypatch):
    import test_report

    from snaketrl.report.render import render
    from snaketrl.report.sweeps import sweep_sections

    runs, _, metrics = sweep_runs()
    runs = {n: r for n, r in runs.items() if r["swept"] in ({"beta": 0.1, "learning_rate": 0.01},
                                                           {"beta": 0.5, "learning_rate": 0.01})}
    monkeypatch.setattr(test_report, "RUNS", runs)
    files = test_report._fake_results(tmp_path)
    evaluated = {}
    for name, m in metrics.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(m))
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
        evaluated[name] = {"metrics": tmp_path / f"{name}.json", "completions": tmp_path / f"{name}.jsonl"}
    html = render(runs=runs, files=files, out=tmp_path / "report.html", evaluated=evaluated,
                  groups={n: r["group"] for n, r in runs.items()})
    section = html[html.index("<h2>Sweeps"):html.index("<h2>Summary of training")]
    assert 'id="sweep-dpo-a"' in section and "<b>rm_judge</b> (evaluation)" in section
    assert "<b>4.00 ± 0.00</b>" in section and section.count('src="data:image/png;base64,') == 1
    plain = {n: {k: v for k, v in r.items() if k not in ("sweep", "swept")} for n, r in runs.items()}
    assert sweep_sections(plain, {}, metrics) == []  # no sweep: no section
