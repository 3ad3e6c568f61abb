"""bench/matrix_cost.py's projection of a matrix: its runs and jobs are those a dry run of the workflow lists for
that matrix, on the default reshaped to three models (the count docs/cluster.md states) and on other shipped
configs."""

import copy
import sys

import pytest
import yaml

from conftest import ROOT
from test_docs import dry_run, stated

sys.path.insert(0, str(ROOT / "bench"))
import matrix_cost  # noqa: E402


def load(name):
    return yaml.safe_load((ROOT / "config" / name).read_text())


def with_copy_of(cfg, model, name):
    """cfg with a copy of one of its models' entries, `name`, in its matrix too: the hand-made reshape."""
    cfg = copy.deepcopy(cfg)
    cfg["models"][name] = copy.deepcopy(cfg["models"][model])
    cfg["matrix"]["models"].append(name)
    return cfg


def dry_run_of(tmp_path, cfg):
    configfile = tmp_path / "hand.yaml"
    configfile.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dry_run(tmp_path, "--configfile", str(configfile))


def test_trainers_bring_the_runs_they_start_from_and_the_evaluation_keeps_the_judges_it_still_has():
    default = load("config.yaml")
    grpo = matrix_cost.matrix(default, 1, ["grpo"])
    assert grpo["matrix"] == {"trainers": ["grpo", "sft"], "models": ["qwen2-tiny"]}
    assert grpo["evaluation"]["reward_models"] == []
    ppo = matrix_cost.matrix(default, None, ["ppo"])
    assert ppo["matrix"] == {"trainers": ["ppo", "sft", "reward"], "models": ["qwen2-tiny", "pythia-tiny"]}
    assert ppo["evaluation"]["reward_models"] == ["reward-qwen2-tiny", "reward-pythia-tiny"]
    assert matrix_cost.matrix(default, None, None) is default
    with pytest.raises(SystemExit, match="--trainers: 'rlhf' has no entry under trainers; expected some of "
                                         r"\['dpo', 'grpo', 'ppo', 'reward', 'sft'\]"):
        matrix_cost.matrix(default, 3, ["sft", "rlhf"])
    with pytest.raises(SystemExit, match="the config has no matrix"):
        matrix_cost.matrix(load("rl-recipes.yaml"), 2, None)


def test_three_models_of_the_default_are_the_jobs_its_dry_run_lists_and_cluster_md_states(tmp_path):
    default = load("config.yaml")
    cfg = matrix_cost.matrix(default, 3, ["sft", "dpo", "grpo", "ppo"])
    assert cfg["models"]["qwen2-tiny-1"] == default["models"]["qwen2-tiny"]
    counts = dry_run_of(tmp_path, with_copy_of(default, "qwen2-tiny", "qwen2-tiny-1"))
    projected = matrix_cost.project(matrix_cost.per_trainer(tmp_path), cfg, 1, tmp_path)
    assert projected["jobs"] == sum(counts.values())
    assert projected["per_trainer"] == dict.fromkeys(["sft", "dpo", "grpo", "ppo", "reward"], 3)
    assert projected["runs"] == counts["train"]
    assert projected["missing"] == ["dpo", "grpo", "ppo", "reward", "sft"]  # no benchmark files in tmp_path
    assert stated("docs/cluster.md", r"is (\d+) training runs") == [projected["runs"]]
    assert stated("docs/cluster.md", r"of training, in (\d+) jobs") == [projected["jobs"]]
    assert stated("docs/cluster.md", r"jobs \((\d+) evaluations") == [counts["evaluate"]]
    assert stated("docs/cluster.md", r"evaluations and (\d+) merges") == [counts["merge"]]


def test_a_config_of_runs_and_a_reshaped_sweep_are_the_jobs_their_dry_runs_list(tmp_path):
    recipes = ROOT / "config" / "rl-recipes.yaml"
    counts = dry_run(tmp_path, "--configfile", str(recipes))
    projected = matrix_cost.project(matrix_cost.per_trainer(tmp_path), load("rl-recipes.yaml"), 1, tmp_path)
    assert (projected["jobs"], projected["runs"]) == (sum(counts.values()), counts["train"])

    sweep = load("examples/sweep.yaml")
    counts = dry_run_of(tmp_path, with_copy_of(sweep, "qwen2-tiny", "qwen2-tiny-1"))
    projected = matrix_cost.project(matrix_cost.per_trainer(tmp_path), matrix_cost.matrix(sweep, 2, None), 1, tmp_path)
    assert projected["per_trainer"] == {"dpo": 24}  # 3 betas x 2 learning rates x 2 seeds x 2 models
    assert (projected["jobs"], projected["runs"]) == (sum(counts.values()), counts["train"])
