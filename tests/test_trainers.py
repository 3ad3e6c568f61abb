"""Every trainer in the registry trains a few steps on a tiny model, through the same train_run."""

import json
import math

import learning
import pytest

from conftest import ROOT
from snaketrl.config import resolve_runs
from snaketrl.data.lengths import tokenize_prompts
from snaketrl.data.preprocess import LAYOUTS, preprocess
from snaketrl.io import read_jsonl, write_jsonl
from snaketrl.trainers import REGISTRY

DATA = {"language_modeling": ("tldr", {}), "preference": ("descriptiveness", {}), "prompt": ("tldr", {})}
FAST = {"max_steps": 3, "logging_steps": 1, "eval_strategy": "no", "save_steps": 100,
        "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4}
PER_TRAINER = {
    "grpo": {"num_generations": 2, "max_completion_length": 8},
    "rloo": {"num_generations": 2, "max_completion_length": 8},
    "online_dpo": {"max_new_tokens": 8},
    "ppo": {"total_episodes": 12, "local_rollout_forward_batch_size": 4, "response_length": 8,
            "num_sample_generations": 0, "num_ppo_epochs": 1, "stop_token": "eos"},
}
# What each trainer's users read, and that must be logged.
EXPECTED = {
    "sft": {"loss", "mean_token_accuracy"},
    "dpo": {"loss", "rewards/accuracies", "rewards/margins"},
    "reward": {"loss", "accuracy", "margin"},
    "grpo": {"loss", "reward", "reward_std", "rewards/unique_chars/mean"},
    "rloo": {"loss", "reward", "rewards/unique_chars/mean"},
    "ppo": {"objective/rlhf_reward", "objective/kl", "loss/policy_avg", "loss/value_avg"},
    "kto": {"loss", "rewards/chosen"},
    "orpo": {"loss", "log_odds_ratio"},
    "online_dpo": {"loss", "objective/scores"},
}


def test_every_registered_trainer_has_a_test():
    assert set(EXPECTED) == set(REGISTRY)
    assert {spec.layout for spec in REGISTRY.values()} <= set(LAYOUTS)


def prepare(tmp, config, tiny_model_dir, trainer, **run_extra):
    from transformers import AutoTokenizer

    dataset, columns = DATA[REGISTRY[trainer].layout]
    config["training"].update(FAST)
    config["trainers"].setdefault(trainer, {"dataset": dataset})
    config["trainers"][trainer]["args"] = PER_TRAINER.get(trainer, {})
    config["trainers"][trainer]["policy"] = None  # these tests start every trainer from the tiny base
    config["trainers"][trainer].update(run_extra)
    # The reward run is there for PPO's reward_model reference; the tests pass its merged model directly.
    config["runs"] = {f"t-{trainer}": {"trainer": trainer, "model": "qwen2-tiny", "dataset": dataset},
                      "reward-qwen2-tiny": {"trainer": "reward", "model": "qwen2-tiny"}}
    config["matrix"] = {"trainers": [], "models": []}
    if trainer in ("grpo", "rloo", "online_dpo") and "reward_model" not in run_extra:
        config["trainers"][trainer]["reward_funcs"] = ["unique_chars"]
    run = resolve_runs(config)[f"t-{trainer}"]
    rows = preprocess(read_jsonl(ROOT / f"data/samples/{dataset}.jsonl")[:24], dataset=dataset, trainer=trainer,
                      layout=REGISTRY[trainer].layout, columns=columns, split="train").rows
    (tmp / "lengths.json").write_text(json.dumps({"max_length": 64}))
    if REGISTRY[trainer].tokenized:
        rows = tokenize_prompts(rows, AutoTokenizer.from_pretrained(tiny_model_dir), 48)
    write_jsonl(rows[:20], tmp / "train.jsonl")
    write_jsonl(rows[20:], tmp / "eval.jsonl")
    return {"run": run, "model_dir": tiny_model_dir,
            "train_file": tmp / "train.jsonl", "eval_file": tmp / "eval.jsonl", "lengths_file": tmp / "lengths.json",
            "out_dir": tmp / "out", "checkpoint_dir": tmp / "ckpt"}


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir):
    """A reward model trained on the learnable descriptiveness sample, merged as PPO loads it."""
    import copy

    import yaml
    from snakemake.utils import validate

    from snaketrl.models.merge import merge
    from snaketrl.train.run import train_run

    tmp = tmp_path_factory.mktemp("reward")
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(cfg, str(ROOT / "config/schema.yaml"))
    inputs = prepare(tmp, copy.deepcopy(cfg), tiny_model_dir, "reward")
    inputs["run"]["args"].update(max_steps=30, eval_strategy="no")
    inputs["run"]["seed"] = learning.seed(inputs["run"]["seed"])
    rows = preprocess(read_jsonl(ROOT / "data/samples/descriptiveness.jsonl"), dataset="d", trainer="reward",
                      layout="preference", columns={}, split="train").rows
    write_jsonl(rows[:300], tmp / "train.jsonl")
    write_jsonl(rows[300:], tmp / "eval.jsonl")
    metrics = train_run(**inputs)
    merge(tmp / "out" / "adapter", tiny_model_dir, tmp / "merged", "SEQ_CLS")
    return tmp / "merged", metrics, inputs["run"]["seed"]


def test_reward_model_loads_as_classifier_and_beats_chance(reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    path, metrics, seed = reward_model_dir
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert model.config.num_labels == 1 and model.score.out_features == 1
    learning.check("reward toy", learning.UNIT["test_reward_model_loads_as_classifier_and_beats_chance"], {},
                   metrics, seed)  # 100 held-out pairs


@pytest.mark.parametrize("trainer", sorted(REGISTRY))
def test_trainer_logs_its_metrics(trainer, tmp_path, config, tiny_model_dir, reward_model_dir, monkeypatch):
    from snaketrl.train import run
    from snaketrl.train.run import train_run

    given_back = []  # a trainer that samples completions gives its freed memory back (snaketrl.processes)
    monkeypatch.setattr(run, "give_back_freed_memory", lambda: given_back.append(trainer))
    inputs = prepare(tmp_path, config, tiny_model_dir, trainer)
    if REGISTRY[trainer].value_model:
        inputs["reward_dir"] = reward_model_dir[0]
    train_run(**inputs)
    assert given_back == ([trainer] if trainer in ("grpo", "rloo", "online_dpo", "ppo") else [])
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logged = {k for entry in state["log_history"] for k in entry}
    assert EXPECTED[trainer] <= logged, sorted(logged)
    values = [v for entry in state["log_history"] for k, v in entry.items() if k in EXPECTED[trainer]]
    assert values and all(math.isfinite(v) for v in values)
    assert state["global_step"] >= 3
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_grpo_scores_with_the_trained_reward_model(tmp_path, config, tiny_model_dir, reward_model_dir, monkeypatch):
    """GRPO with the reward model alone, on plain prompts; its policy trains a chat template's added token's rows
    (test_plan.with_added_rows). metrics.json records the plan's two decisions for it: the reward model reads the
    plain prompts with eos, and generation runs with the trained rows merged."""
    import snaketrl.train.run as run_module
    from snaketrl.train.run import train_run
    from test_plan import with_added_rows

    merges, merge_rows = [], run_module.merge_rows_for_generation
    monkeypatch.setattr(run_module, "merge_rows_for_generation", lambda *a: merges.append(a[1]) or merge_rows(*a))
    inputs = prepare(tmp_path, config, with_added_rows(tmp_path, tiny_model_dir), "grpo", reward_model=None)
    inputs["run"]["reward_funcs"] = []
    train_run(**inputs, reward_dir=reward_model_dir[0])
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["reward_read_as_trained"] is True and metrics["merged_token_rows"] is True and merges == ["grpo"]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert any(k.startswith("rewards/") and k.endswith("/mean") for e in state["log_history"] for k in e)
    # GRPO trained on the score the judge gives: its plain prompts and completions read with eos, as the reward
    # model was trained (snaketrl.data.reward_text). TRL read them without eos, a score the judge does not give.
    from snaketrl.evaluate.scoring import reward_model_scores

    samples = read_jsonl(tmp_path / "out" / "training_samples.jsonl")
    assert len(samples) >= 16 and isinstance(samples[0]["prompt"], str)
    judged = reward_model_scores(reward_model_dir[0], [r["prompt"] for r in samples], [r["completion"] for r in samples])
    assert [r["reward"] for r in samples] == pytest.approx(judged, abs=1e-4)


def test_reward_model_with_another_tokenizer_is_refused(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from snaketrl.config import ConfigError
    from snaketrl.models.tiny import train_tokenizer
    from snaketrl.train.loading import check_reward_tokenizer

    other = train_tokenizer(["a small corpus for another tokenizer"] * 10, vocab_size=300)
    other.save_pretrained(tmp_path / "other")
    policy = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"run 'ppo-x': the reward model .*other has another tokenizer than the "
                                          r"policy \(vocab \d+ vs 1024"):
        check_reward_tokenizer(policy, tmp_path / "other", "ppo-x")
    check_reward_tokenizer(policy, tiny_model_dir, "ppo-x")
