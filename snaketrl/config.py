"""Config checks that JSON schema cannot express, and the run matrix.

Pure Python (no torch/transformers/trl): the Snakefile calls this at parse time.
"""

from __future__ import annotations

import copy
import re

from snaketrl.trainers import REGISTRY


class ConfigError(ValueError):
    pass


def validate(config: dict, schema_path: str) -> None:
    """Validate against the JSON schema, filling its defaults (snakemake.utils.validate); a failure
    becomes one line naming the key path and what was expected."""
    from snakemake.utils import validate as snakemake_validate

    try:
        snakemake_validate(config, schema_path)
    except Exception as err:
        import jsonschema
        import yaml

        with open(schema_path) as f:
            schema = yaml.safe_load(f)
        best = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
        if best is None:
            raise
        path = ".".join(str(p) for p in best.absolute_path) or "(top level)"
        if best.validator == "oneOf" and all("required" in alt for alt in best.validator_value):
            expected = " or ".join(f"'{alt['required'][0]}'" for alt in best.validator_value)
            message = f"needs exactly one of {expected}"
        else:
            message = best.message
        raise ConfigError(f"config: {path}: {message}") from None


def expand_runs(config: dict) -> dict[str, dict]:
    """Run name -> {trainer, model, dataset, args}: the matrix first, then `runs` entries on top."""
    runs: dict[str, dict] = {}
    matrix = config.get("matrix", {})
    for trainer in matrix.get("trainers", []):
        for model in matrix.get("models", []):
            runs[f"{trainer}-{model}"] = {"trainer": trainer, "model": model, "args": {}}
    for name, entry in config.get("runs", {}).items():
        run = runs.setdefault(name, {"args": {}})
        run.update({k: copy.deepcopy(v) for k, v in entry.items() if k != "args"})
        run["args"] = {**run.get("args", {}), **entry.get("args", {})}
    for name, run in runs.items():
        for key in ("trainer", "model"):
            if key not in run:
                raise ConfigError(f"config: runs.{name}: missing '{key}' (not a matrix run, so it must name one)")
        if run["trainer"] in config["trainers"] and "dataset" not in run:
            run["dataset"] = config["trainers"][run["trainer"]]["dataset"]
    return runs


def check(config: dict) -> dict[str, dict]:
    """Cross-reference checks; returns the expanded runs. Errors name the key path."""
    known = sorted(REGISTRY)
    for trainer in config["trainers"]:
        if trainer not in REGISTRY:
            raise ConfigError(f"config: trainers.{trainer}: unknown trainer; expected one of {known}")
    for name, entry in config["trainers"].items():
        if entry["dataset"] not in config["datasets"]:
            raise ConfigError(f"config: trainers.{name}.dataset: unknown dataset '{entry['dataset']}'; "
                              f"expected one of {sorted(config['datasets'])}")
    runs = expand_runs(config)
    if not runs:
        raise ConfigError("config: no runs: set matrix.trainers and matrix.models, or add entries to runs")
    for name, run in runs.items():
        where = f"runs.{name}" if name in config.get("runs", {}) else f"matrix (run {name})"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ConfigError(f"config: {where}: run name may hold only letters, digits, '_', '.', '-'")
        if run["trainer"] not in REGISTRY:
            raise ConfigError(f"config: {where}.trainer: unknown trainer '{run['trainer']}'; expected one of {known}")
        if run["trainer"] not in config["trainers"]:
            raise ConfigError(f"config: {where}.trainer: trainer '{run['trainer']}' has no entry under trainers "
                              f"(it needs at least its dataset)")
        for key, pool in (("model", "models"), ("dataset", "datasets")):
            if run[key] not in config[pool]:
                raise ConfigError(f"config: {where}.{key}: unknown {key} '{run[key]}'; "
                                  f"expected one of {sorted(config[pool])}")
    for name, model in config["models"].items():
        if not model.get("lora", {}).get("target_modules") and not config["lora"].get("target_modules"):
            raise ConfigError(f"config: models.{name}.lora.target_modules: missing; LoRA targets differ per "
                              f"architecture (q_proj,k_proj,v_proj for Qwen2/Llama, query_key_value for GPT-NeoX)")
    return runs


def trl_args(config: dict, run: dict) -> dict:
    """TRL config fields: shared training defaults < per-trainer args < per-run args."""
    return {**config.get("training", {}), **config["trainers"][run["trainer"]].get("args", {}), **run.get("args", {})}


def lora_args(config: dict, model: str) -> dict:
    return {**config.get("lora", {}), **config["models"][model].get("lora", {})}
