import copy
import re

import pytest

from conftest import ROOT
from snaketrl.config import ConfigError, expand_runs, lora_args, resolve_runs, trl_args, validate

SCHEMA = str(ROOT / "config" / "schema.yaml")


def test_default_expands_to_trainer_by_model_matrix(config):
    runs = resolve_runs(config)
    assert sorted(runs) == [f"{t}-{m}" for t in ("dpo", "grpo", "ppo", "reward", "sft")
                            for m in ("pythia-tiny", "qwen2-tiny")]
    dpo = runs["dpo-qwen2-tiny"]
    assert (dpo["name"], dpo["trainer"], dpo["model"], dpo["dataset"]) == ("dpo-qwen2-tiny", "dpo", "qwen2-tiny",
                                                                          "ultrafeedback")
    # Resolved: shared training < trainer args; LoRA defaults < the model's; the entries it reads.
    assert dpo["args"] == {**config["training"], "beta": 0.1, "eval_on_start": True}
    assert dpo["lora"] == {**config["lora"], "target_modules": ["q_proj", "k_proj", "v_proj"]}
    assert dpo["model_entry"] == config["models"]["qwen2-tiny"] and dpo["seed"] == config["seed"]
    assert runs["ppo-qwen2-tiny"]["dataset"] == "descriptiveness"
    assert runs["ppo-qwen2-tiny"]["policy"] == "sft-qwen2-tiny"
    assert runs["ppo-qwen2-tiny"]["reward_model"] == "reward-qwen2-tiny"
    assert "score" in runs["reward-qwen2-tiny"]["lora"]["modules_to_save"]


def test_resolved_runs_do_not_depend_on_key_order(config):
    import json

    def reverse(value):
        return {k: reverse(value[k]) for k in reversed(list(value))} if isinstance(value, dict) else value

    a, b = resolve_runs(config), resolve_runs(reverse(copy.deepcopy(config)))
    assert repr(a) == repr(b)  # Snakemake compares params by repr
    assert all(json.dumps(run) == json.dumps(run, sort_keys=True) for run in a.values())


def test_schema_fills_defaults(config):
    assert config["length"] == {"keep_share": 0.99, "round_to": 32, "batching": "auto"}
    assert config["datasets"]["tldr"]["eval_size"] == 0.1
    assert config["datasets"]["tldr"]["columns"] == {}
    assert config["models"]["qwen2-tiny"]["quantization"] is None


def test_wrong_type_names_the_key(config):
    config["length"]["keep_share"] = "most"
    with pytest.raises(ConfigError, match=r"^config: length.keep_share: 'most' is not of type 'number'$"):
        validate(config, SCHEMA)


def test_model_needs_hub_or_tiny(config):
    config["models"]["broken"] = {"lora": {"target_modules": ["q_proj"]}}
    with pytest.raises(ConfigError, match=r"^config: models.broken: needs exactly one of 'hub', 'tiny' or 'gguf'$"):
        validate(config, SCHEMA)


def test_unknown_trainer(config):
    config["trainers"]["ppx"] = {"dataset": "tldr"}
    with pytest.raises(ConfigError, match=r"^config: trainers.ppx: unknown trainer; expected one of \['dpo', 'grpo'"):
        resolve_runs(config)


def test_unknown_model_in_run(config):
    config["runs"]["extra"] = {"trainer": "sft", "model": "llama-huge"}
    with pytest.raises(ConfigError, match=r"runs.extra.model: unknown model 'llama-huge'; expected one of "
                                          r"\['pythia-tiny', 'qwen2-tiny'\]"):
        resolve_runs(config)


def test_unknown_model_in_matrix(config):
    config["matrix"]["models"].append("gpt-7")
    with pytest.raises(ConfigError, match=r"^config: matrix.models: unknown model 'gpt-7'; expected one of"):
        resolve_runs(config)


def test_unknown_dataset_in_run(config):
    config["runs"]["sft-qwen2-tiny"] = {"dataset": "wikitext", "args": {}}
    with pytest.raises(ConfigError, match=r"runs.sft-qwen2-tiny.dataset: unknown dataset 'wikitext'"):
        resolve_runs(config)


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


def test_max_tokens_is_a_runs_and_refused_beside_max_steps_or_for_a_generating_trainer(config):
    config["training"].pop("max_steps", None)
    config["trainers"]["sft"]["max_tokens"] = 4000
    config["runs"]["dpo-qwen2-tiny"] = {"max_tokens": 2000}
    runs = resolve_runs(copy.deepcopy(config))
    assert runs["sft-qwen2-tiny"]["max_tokens"] == 4000 and runs["dpo-qwen2-tiny"]["max_tokens"] == 2000
    assert "max_tokens" not in runs["reward-qwen2-tiny"]  # absent where unset: its params stay as they were
    config["trainers"]["sft"]["args"]["max_steps"] = 5
    with pytest.raises(ConfigError, match=r"^config: trainers.sft.max_tokens \(run sft-qwen2-tiny\): max_tokens sets "
                                          r"max_steps; the run also sets args.max_steps: keep one$"):
        resolve_runs(copy.deepcopy(config))
    del config["trainers"]["sft"]["args"]["max_steps"]
    config["runs"]["grpo-qwen2-tiny"] = {"max_tokens": 2000}
    with pytest.raises(ConfigError, match=r"^config: runs.grpo-qwen2-tiny.max_tokens \(run grpo-qwen2-tiny\): grpo "
                                          r"generates its completions, so its tokens per step are not known before "
                                          r"training; bound it with args.max_steps$"):
        resolve_runs(copy.deepcopy(config))
    config["runs"]["grpo-qwen2-tiny"] = {"max_tokens": "lots"}
    with pytest.raises(Exception, match="'lots' is not of type 'integer', 'null'"):
        validate(config, str(ROOT / "config" / "schema.yaml"))


def test_max_flops_is_a_runs_for_every_trainer_read_from_yaml_text_and_refused_unless_positive(config):
    """Inherited from the trainer's entry, overridden by a run's, for generating trainers too (PPO); PyYAML reads
    1.0e12 and 1e12 as text, which is read as the number; the value is in the run's params, so editing it changes
    that run's params alone."""
    import yaml

    config["trainers"]["ppo"]["max_flops"] = yaml.safe_load("x: 1.0e12")["x"]
    config["runs"]["grpo-qwen2-tiny"] = {"max_flops": yaml.safe_load("x: 2e9")["x"]}
    assert config["trainers"]["ppo"]["max_flops"] == "1.0e12"  # what PyYAML hands over
    validate(config, SCHEMA)
    runs = resolve_runs(copy.deepcopy(config))
    assert runs["ppo-qwen2-tiny"]["max_flops"] == runs["ppo-pythia-tiny"]["max_flops"] == 1.0e12
    assert runs["grpo-qwen2-tiny"]["max_flops"] == 2.0e9 and "max_flops" not in runs["grpo-pythia-tiny"]
    config["runs"]["grpo-qwen2-tiny"]["max_flops"] = 3e9
    edited = resolve_runs(copy.deepcopy(config))
    assert [name for name in runs if runs[name] != edited[name]] == ["grpo-qwen2-tiny"]
    for value in ("lots", "0", "-1e3", "nan", float("inf"), 0):
        config["trainers"]["ppo"]["max_flops"] = value
        with pytest.raises(ConfigError, match=rf"^config: trainers.ppo.max_flops \(run ppo-(pythia|qwen2)-tiny\): "
                                              rf"max_flops must be a positive number of FLOPs, such as 1.0e12 \(got "
                                              rf"{re.escape(repr(value))}\)$"):
            resolve_runs(copy.deepcopy(config))
    config["trainers"]["ppo"]["max_flops"] = -5
    with pytest.raises(ConfigError, match=r"^config: trainers.ppo.max_flops: -5 is less than or equal to the "
                                          r"minimum of 0$"):
        validate(config, SCHEMA)
    config["trainers"]["ppo"]["max_flops"] = [1]
    with pytest.raises(ConfigError, match=r"^config: trainers.ppo.max_flops: \[1\] is not of type 'number', "
                                          r"'string', 'null'$"):
        validate(config, SCHEMA)


def test_no_runs_is_an_error(config):
    config["matrix"] = {"trainers": [], "models": []}
    with pytest.raises(ConfigError, match="no runs"):
        resolve_runs(copy.deepcopy(config))


def test_grpo_batch_not_divisible_by_num_generations(config):
    config["trainers"]["grpo"]["args"].update(num_generations=3)
    with pytest.raises(ConfigError, match=r"matrix \(run grpo-qwen2-tiny\): generation batch 16 \("
                                          r"per_device_train_batch_size x steps_per_generation\) is not divisible "
                                          r"by num_generations=3"):
        resolve_runs(config)


def test_grpo_eval_batch_checked_when_evaluating(config):
    config["trainers"]["grpo"]["args"].update(eval_strategy="steps", num_generations=8)
    config["training"]["per_device_eval_batch_size"] = 12
    with pytest.raises(ConfigError, match=r"per_device_eval_batch_size=12 is not divisible by num_generations=8"):
        resolve_runs(config)


def test_generation_defaults_match_installed_trl():
    import dataclasses

    from trl import GRPOConfig, RLOOConfig

    from snaketrl.config import BATCH_DEFAULTS, GENERATION_DEFAULTS

    for trainer, cls in (("grpo", GRPOConfig), ("rloo", RLOOConfig)):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for key, value in {**BATCH_DEFAULTS, **GENERATION_DEFAULTS[trainer]}.items():
            assert defaults[key] == value, (trainer, key)


def test_wrong_reward_function_name(config):
    config["trainers"]["grpo"]["reward_funcs"] = ["unique_chars", "lenght"]
    with pytest.raises(ConfigError, match=r"reward_funcs: unknown reward function 'lenght'"):
        resolve_runs(config)


def test_a_builtin_reward_functions_kwargs_are_checked_at_parse_time(config):
    config["trainers"]["grpo"]["reward_funcs"] = [{"function": "rouge", "kwargs": {"knd": "rouge1"}}]
    with pytest.raises(ConfigError, match=r"^config: trainers.grpo.reward_funcs: rouge: unknown kwargs key 'knd' "
                                          r"\(did you mean 'kind'\?\); rouge takes \['kind'\]$"):
        resolve_runs(config)
    config["trainers"]["grpo"]["reward_funcs"] = [{"function": "rouge", "kwargs": {"kind": "rougeLsum"}}]
    with pytest.raises(ConfigError, match=r"^config: trainers.grpo.reward_funcs: rouge: kind must be one of "
                                          r"rouge1, rouge2, rougeL, got 'rougeLsum'$"):
        resolve_runs(config)
    config["trainers"]["grpo"]["reward_funcs"] = [{"function": "accuracy", "kwargs": {"match": "flexible"}}]
    assert resolve_runs(config)


def test_ppo_reward_model_must_be_a_reward_run(config):
    config["trainers"]["ppo"]["reward_model"] = "sft-{model}"
    with pytest.raises(ConfigError, match=r"^config: trainers.ppo.reward_model \(run ppo-qwen2-tiny\): run "
                                          r"'sft-qwen2-tiny' trains 'sft', not a reward model$"):
        resolve_runs(config)
    config["trainers"]["ppo"]["reward_model"] = None
    with pytest.raises(ConfigError, match=r"ppo needs a reward_model"):
        resolve_runs(config)


def test_ppo_runs_point_at_their_models_reward_run(config):
    runs = resolve_runs(config)
    assert runs["ppo-pythia-tiny"]["reward_model"] == "reward-pythia-tiny"
    assert runs["grpo-qwen2-tiny"]["reward_funcs"] == ["keyword"]


def test_tokens_in_config_are_refused(config):
    config["training"]["hub_token"] = "hf_x"
    with pytest.raises(ConfigError, match=r"^config: training.hub_token: secrets do not belong in config; set HF_TOKEN"):
        resolve_runs(config)


def test_workflow_paths_are_found_where_the_workflow_is_and_params_keep_them_as_written(config, tmp_path,
                                                                                       monkeypatch):
    """`workflow:<path>` is a file shipped with the workflow (the Snakefile's `shipped`), from any working
    directory; the resolved runs (the train job's params) keep the config's strings, so they do not change
    when the working directory does."""
    import os
    import shutil
    from functools import partial

    from snaketrl import paths
    from snaketrl.config import corpus_files, local_files

    shipped = partial(os.path.join, str(ROOT))
    config["models"]["qwen2-tiny"]["tiny"]["corpus"] = ["tldr", "workflow:data/samples/firefly.jsonl"]
    at_root = resolve_runs(config, shipped)
    monkeypatch.chdir(tmp_path)  # a user's directory: no data/ here
    assert repr(resolve_runs(config, shipped)) == repr(at_root)
    assert at_root["sft-qwen2-tiny"]["dataset_entry"]["files"] == "workflow:data/samples/tldr.jsonl"
    assert local_files(config["datasets"]["tldr"], shipped) == {"train": f"{ROOT}/data/samples/tldr.jsonl"}
    assert corpus_files(config, "qwen2-tiny", shipped) == [paths.raw("tldr", "train"),
                                                           f"{ROOT}/data/samples/firefly.jsonl"]
    assert paths.from_config("mine/train.jsonl", shipped) == "mine/train.jsonl"  # the user's: as written
    shutil.copytree(ROOT / "config", tmp_path / "config")  # a workflow with its accelerate configs, no samples
    with pytest.raises(ConfigError, match=r"^config: datasets.descriptiveness.files: train file workflow:data/samples/"
                                          r"descriptiveness.jsonl does not exist in the workflow "
                                          rf"\({tmp_path}/data/samples/descriptiveness.jsonl\)$"):
        resolve_runs(config, partial(os.path.join, str(tmp_path)))
