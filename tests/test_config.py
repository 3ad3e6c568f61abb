import copy

import pytest

from conftest import ROOT
from snaketrl.config import ConfigError, check, expand_runs, lora_args, trl_args, validate

SCHEMA = str(ROOT / "config" / "schema.yaml")


def test_default_expands_to_trainer_by_model_matrix(config):
    runs = check(config)
    assert sorted(runs) == ["dpo-pythia-tiny", "dpo-qwen2-tiny", "sft-pythia-tiny", "sft-qwen2-tiny"]
    assert runs["dpo-qwen2-tiny"] == {"trainer": "dpo", "model": "qwen2-tiny", "dataset": "ultrafeedback",
                                      "args": {}}


def test_schema_fills_defaults(config):
    assert config["length"] == {"keep_share": 0.99, "round_to": 32}
    assert config["datasets"]["tldr"]["eval_size"] == 0.1
    assert config["datasets"]["tldr"]["columns"] == {}
    assert config["models"]["qwen2-tiny"]["quantization"] is None


def test_wrong_type_names_the_key(config):
    config["length"]["keep_share"] = "most"
    with pytest.raises(ConfigError, match=r"^config: length.keep_share: 'most' is not of type 'number'$"):
        validate(config, SCHEMA)


def test_model_needs_hub_or_tiny(config):
    config["models"]["broken"] = {"lora": {"target_modules": ["q_proj"]}}
    with pytest.raises(ConfigError, match=r"^config: models.broken: needs exactly one of 'hub' or 'tiny'$"):
        validate(config, SCHEMA)


def test_unknown_trainer(config):
    config["trainers"]["ppx"] = {"dataset": "tldr"}
    with pytest.raises(ConfigError, match=r"^config: trainers.ppx: unknown trainer; expected one of \['dpo', 'sft'"):
        check(config)


def test_unknown_model_in_run(config):
    config["runs"]["extra"] = {"trainer": "sft", "model": "llama-huge"}
    with pytest.raises(ConfigError, match=r"runs.extra.model: unknown model 'llama-huge'; expected one of "
                                          r"\['pythia-tiny', 'qwen2-tiny'\]"):
        check(config)


def test_unknown_model_in_matrix(config):
    config["matrix"]["models"].append("gpt-7")
    with pytest.raises(ConfigError, match=r"matrix \(run sft-gpt-7\).model: unknown model 'gpt-7'"):
        check(config)


def test_unknown_dataset_in_run(config):
    config["runs"]["sft-qwen2-tiny"] = {"dataset": "wikitext", "args": {}}
    with pytest.raises(ConfigError, match=r"runs.sft-qwen2-tiny.dataset: unknown dataset 'wikitext'"):
        check(config)


def test_run_overrides_merge_over_matrix(config):
    config["runs"]["sft-qwen2-tiny"] = {"dataset": "firefly", "args": {"learning_rate": 1e-4}}
    runs = expand_runs(config)
    assert runs["sft-qwen2-tiny"]["dataset"] == "firefly"
    args = trl_args(config, runs["sft-qwen2-tiny"])
    assert args["learning_rate"] == 1e-4  # run beats the shared training defaults
    assert args["per_device_train_batch_size"] == 8
    dpo = trl_args(config, runs["dpo-qwen2-tiny"])
    assert dpo["beta"] == 0.1 and dpo["learning_rate"] == config["training"]["learning_rate"]


def test_lora_targets_per_architecture(config):
    assert lora_args(config, "qwen2-tiny")["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    assert lora_args(config, "pythia-tiny") == {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                                                "target_modules": ["query_key_value"]}


def test_no_runs_is_an_error(config):
    config["matrix"] = {"trainers": [], "models": []}
    with pytest.raises(ConfigError, match="no runs"):
        check(copy.deepcopy(config))
