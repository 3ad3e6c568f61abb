"""Config checks that JSON schema cannot express, and the run matrix.

Pure Python (no torch/transformers/trl): the Snakefile calls this at parse time.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from pathlib import Path

from snaketrl import paths
from snaketrl.config.sweeps import with_sweeps
from snaketrl.errors import ConfigError
from snaketrl.models.gguf import check_source
from snaketrl.rewards import BUILTINS
from snaketrl.train import distributed
from snaketrl.train.args import check_switches
from snaketrl.trainers import BATCHING_FIELDS, REGISTRY


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
            names = [f"'{alt['required'][0]}'" for alt in best.validator_value]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
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
        defaults = config["trainers"].get(run["trainer"], {})
        for key in INHERITED:
            if key not in run and key in defaults:
                run[key] = copy.deepcopy(defaults[key])
        for key in ("reward_model", "policy"):
            if run.get(key):
                run[key] = run[key].format(model=run["model"])
    return runs


INHERITED = ("dataset", "reward_funcs", "reward_model", "policy", "distributed", "eval_rows")

# TRL 1.12 defaults of the fields in its generation-batch rule (tests/test_config.py checks they
# still match the installed GRPOConfig), so the rule is checked at parse time without importing trl.
GENERATION_DEFAULTS = {"grpo": {"num_generations": 8}, "rloo": {"num_generations": 2}}
BATCH_DEFAULTS = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 8,
                  "gradient_accumulation_steps": 1, "eval_strategy": "no", "max_completion_length": 512}


def check_generation_batch(trainer: str, args: dict, where: str) -> None:
    """TRL's rule, single process: the generation batch (per-device batch x steps per generation)
    must hold whole groups of num_generations completions; so must the eval batch."""
    a = {**BATCH_DEFAULTS, **GENERATION_DEFAULTS[trainer], **args}
    n = a["num_generations"]
    if not isinstance(n, int) or n < 2:
        raise ConfigError(f"config: {where}: num_generations must be an integer >= 2 (got {n!r})")
    if not isinstance(a["max_completion_length"], int) or a["max_completion_length"] < 1:
        raise ConfigError(f"config: {where}: max_completion_length must be a positive integer "
                          f"(got {a['max_completion_length']!r})")
    gen = a.get("generation_batch_size") or a["per_device_train_batch_size"] * (
        a.get("steps_per_generation") or a["gradient_accumulation_steps"])
    if gen % n:
        raise ConfigError(f"config: {where}: generation batch {gen} (per_device_train_batch_size x "
                          f"steps_per_generation) is not divisible by num_generations={n}; TRL needs whole groups")
    n_eval = a.get("num_generations_eval") or n
    if a["eval_strategy"] != "no" and a["per_device_eval_batch_size"] % n_eval:
        raise ConfigError(f"config: {where}: per_device_eval_batch_size={a['per_device_eval_batch_size']} is not "
                          f"divisible by num_generations={n_eval}; TRL needs whole groups")


def check(config: dict, shipped: Callable[[str], str] | None = None) -> dict[str, dict]:
    """Cross-reference checks; returns every run fully resolved (see resolve_run). Errors name the key path.
    `shipped(rel)`: the path of a file that ships with the workflow (the Snakefile's; without it, files of the
    workflow are looked up from the working directory, as from the clone's root: see paths.from_config)."""
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
    runs = with_sweeps(config, runs)
    for name, run in runs.items():
        where = f"runs.{name}" if name in config.get("runs", {}) else f"matrix (run {name})"
        if run.get("sweep"):
            where = f"sweeps.{run['trainer']} (run {name})"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.~+-]*", name):  # '~' and '+': swept values (snaketrl.config.sweeps)
            raise ConfigError(f"config: {where}: run name may hold only letters, digits, '_', '.', '~', '+', '-'")
        if run["trainer"] not in REGISTRY:
            raise ConfigError(f"config: {where}.trainer: unknown trainer '{run['trainer']}'; expected one of {known}")
        if run["trainer"] not in config["trainers"]:
            raise ConfigError(f"config: {where}.trainer: trainer '{run['trainer']}' has no entry under trainers "
                              f"(it needs at least its dataset)")
        for key, pool in (("model", "models"), ("dataset", "datasets")):
            if run[key] not in config[pool]:
                raise ConfigError(f"config: {where}.{key}: unknown {key} '{run[key]}'; "
                                  f"expected one of {sorted(config[pool])}")
        _check_run_rewards(config, runs, name, run, where)
        distributed.check(config, name, run, where, shipped)
        for key in trl_args(config, run):
            if key.endswith("_token") and key.startswith(("hub", "push_to_hub")):  # a secret would reach manifests
                raise ConfigError(f"config: {where}: '{key}': secrets do not belong in config; set HF_TOKEN "
                                  f"in the environment")
        _check_run_batching(config, run, where)
        check_switches(run["trainer"], trl_args(config, run), where, run["model"], config["models"][run["model"]])
    for name, model in config["models"].items():
        if "gguf" in model:
            check_source(name, model["gguf"])
        if not model.get("lora", {}).get("target_modules") and not config["lora"].get("target_modules"):
            raise ConfigError(f"config: models.{name}.lora.target_modules: missing; LoRA targets differ per "
                              f"architecture (q_proj,k_proj,v_proj for Qwen2/Llama, query_key_value for GPT-NeoX)")
    _check_batching(config, {run["trainer"] for run in runs.values()})
    _check_local_files(config, runs, shipped)
    return {name: resolve_run(config, name, run) for name, run in with_seeds(config, runs).items()}


def batching_of(config: dict, trainer: str) -> str:
    """The batching length.batching asks of `trainer`: one for all, or per trainer (auto where unnamed)."""
    batching = config.get("length", {}).get("batching", "auto")
    return batching if isinstance(batching, str) else batching.get(trainer, "auto")


def _check_batching(config: dict, trainers: set[str]) -> None:
    batching = config.get("length", {}).get("batching", "auto")
    if isinstance(batching, dict):
        for trainer in batching:
            if trainer not in REGISTRY:
                raise ConfigError(f"config: length.batching.{trainer}: unknown trainer; expected one of "
                                  f"{sorted(REGISTRY)}")
    for trainer in sorted(trainers):
        spec, wanted = REGISTRY[trainer], batching_of(config, trainer)
        if wanted != "auto" and wanted not in spec.batching:
            where = "length.batching" + ("" if isinstance(batching, str) else f".{trainer}")
            why = f" ({spec.batching_note})" if spec.batching_note else ""
            raise ConfigError(f"config: {where}: '{wanted}' is not possible for trainer '{trainer}'; it can use "
                              f"{', '.join(spec.batching)}{why}")


def _check_run_batching(config: dict, run: dict, where: str) -> None:
    """The batching fields belong to length.batching; padding_free works only where TRL applies it."""
    args = trl_args(config, run)
    for key in BATCHING_FIELDS:
        if key in args:
            raise ConfigError(f"config: {where}: '{key}' is set by the length stage's batching choice; use "
                              f"length.batching (auto, padded, grouped, packed) instead")
    if args.get("padding_free"):
        if run["trainer"] != "sft":
            raise ConfigError(f"config: {where}: padding_free: TRL 1.12 applies it only in SFT (its DPO falls back "
                              f"to padding); length.batching: grouped pads each batch only to its neighbours")
        if batching_of(config, "sft") != "packed":
            raise ConfigError(f"config: {where}: padding_free: TRL 1.12 needs packing with it when max_length is "
                              f"set (the length histogram sets it); set length.batching to packed for sft")


def with_seeds(config: dict, runs: dict[str, dict]) -> dict[str, dict]:
    """Each run once per seed of `seeds` (its own, else the top level's) as `<run>-seed<N>`, its `group` the
    run's name; without seeds, the run itself with the global seed. A seeded run's reward model and policy
    are the same seed's runs of theirs. Data splits and tiny bases keep the global seed: seeds vary only
    the training, so their spread is the training's noise."""
    def names(name):
        seeds = runs[name].get("seeds") or config.get("seeds")
        return {s: f"{name}-seed{s}" for s in seeds} if seeds else {config["seed"]: name}

    out = {}
    for name, run in runs.items():
        for seed, seeded in names(name).items():
            new = {**{k: v for k, v in run.items() if k != "seeds"}, "group": name, "seed": seed}
            for key in ("reward_model", "policy"):
                if run.get(key):
                    theirs = names(run[key])
                    new[key] = theirs.get(seed, next(iter(theirs.values())))
            out[seeded] = new
    return out


def _check_local_files(config: dict, runs: dict, shipped=None) -> None:
    """Local data and corpus files of what the runs use must exist: say so now, not in a job."""
    used_models = {run["model"] for run in runs.values()}
    used_datasets = {run["dataset"] for run in runs.values()}
    for name in sorted(used_datasets):
        for split, path in _written_files(config["datasets"][name]).items():
            if not Path(paths.from_config(path, shipped)).is_file():
                raise ConfigError(f"config: datasets.{name}.files: {split} file {path} does not exist"
                                  f"{_where_looked(path, shipped)}")
    for name in sorted(used_models):
        if "tiny" in config["models"][name]:
            corpus_files(config, name, shipped)
        path = config["models"][name].get("gguf", {}).get("path")
        if path and not Path(paths.from_config(path, shipped)).is_file():
            raise ConfigError(f"config: models.{name}.gguf.path: {path} does not exist{_where_looked(path, shipped)}")


def _where_looked(path: str, shipped) -> str:
    """Where a missing file was looked for, and the fix when the workflow ships it: a config copied from the
    default, or written for a run inside the clone, names the samples relative to the clone."""
    if path.startswith(paths.SHIPPED_PREFIX):
        return f" in the workflow ({paths.from_config(path, shipped)})" if shipped else ""
    if os.path.isabs(path) or shipped is None:
        return ""
    hint = f" (relative paths are read from the working directory, {os.getcwd()}"
    if Path(shipped(path)).is_file():
        return f"{hint}; the workflow ships {path}: write {paths.SHIPPED_PREFIX}{path})"
    return hint + ")"


def corpus_files(config: dict, model: str, shipped: Callable[[str], str] | None = None) -> list[str]:
    """The files a tiny model's tokenizer and pretraining read. A corpus entry that names a dataset of the
    config stands for its train split as fetched: its eval rows (the evaluation's prompts and references)
    never reach pretraining. Any other entry is a local .jsonl/.txt file (`workflow:<path>`: one shipped with
    the workflow, found by `shipped`; see paths.from_config)."""
    out = []
    for item in config["models"][model]["tiny"]["corpus"]:
        if item in config["datasets"]:
            out.append(paths.raw(item, "train"))
        elif Path(paths.from_config(item, shipped)).is_file():
            out.append(paths.from_config(item, shipped))
        else:
            raise ConfigError(f"config: models.{model}.tiny.corpus: '{item}' is neither a dataset of this config "
                              f"({', '.join(sorted(config['datasets']))}) nor an existing .jsonl/.txt file"
                              f"{_where_looked(item, shipped)}")
    return out


def local_files(entry: dict, shipped: Callable[[str], str] | None = None) -> dict[str, str]:
    """split -> the local file of a dataset entry that the get_dataset job reads (none for a Hub dataset);
    `workflow:<path>` resolved by `shipped` (paths.from_config)."""
    return {split: paths.from_config(path, shipped) for split, path in _written_files(entry).items()}


def _written_files(entry: dict) -> dict[str, str]:
    """split -> a dataset entry's local file as written in the config."""
    files = entry.get("files")
    if files is None:
        return {}
    return dict(files) if isinstance(files, dict) else {"train": files}


def model_entry(entry: dict) -> dict:
    """A model's entry without its `threads`: those are the job's (Snakemake's threads, lowered to --cores), so a
    machine with other cores reruns nothing; the manifest records them (numerics.threads)."""
    return {key: value for key, value in entry.items() if key != "threads"}


def model_source_entry(entry: dict) -> dict:
    """What decides a downloaded model's files: its source (hub, revision, trust_remote_code; or gguf), not how
    runs train it (lora, quantization, chat, threads)."""
    return {key: entry[key] for key in ("hub", "revision", "trust_remote_code", "gguf") if key in entry}


def chat_model(entry: dict) -> bool:
    """A chat model: its tokenizer ships a chat template that its prompts are meant to be in. Decided from the
    config (models.<name>.chat; default: a hub or gguf model is one, a tiny model is not), so that each job's
    params carry it; the jobs check that such a model has a template."""
    chat = entry.get("chat")
    return "tiny" not in entry if chat is None else chat


def chat_prompts(model_entry: dict, dataset_entry: dict) -> bool:
    """Whether a dataset's plain-text prompts reach a model as chat turns (snaketrl.data.chat.as_chat):
    datasets.<name>.chat, `auto` (the default) meaning for chat models."""
    wanted = dataset_entry.get("chat", "auto")
    return chat_model(model_entry) if wanted == "auto" else wanted


def gguf_file(entry: dict, shipped: Callable[[str], str] | None = None) -> dict[str, str]:
    """{"gguf": file} of a model converted from a local GGUF file (the download job's input), else {}."""
    path = entry.get("gguf", {}).get("path")
    return {"gguf": paths.from_config(path, shipped)} if path else {}


def canonical(value):
    """Dicts with their keys sorted, recursively. Snakemake compares a job's params by repr, so without
    this the same config with its keys in another order would rerun jobs."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def resolve_run(config: dict, name: str, run: dict) -> dict:
    """Everything that decides a run's training, resolved: the train job's params, the manifest's config and
    (with its input hashes) the resume fingerprint."""
    lora = lora_args(config, run["model"])
    if REGISTRY[run["trainer"]].task_type == "SEQ_CLS":
        # Known TRL pitfall: without this the freshly initialised `score` head is neither trained nor saved.
        lora["modules_to_save"] = sorted({*lora.get("modules_to_save", []), "score"})
    return canonical({
        "name": name, "trainer": run["trainer"], "model": run["model"], "dataset": run["dataset"],
        "args": trl_args(config, run), "lora": lora,
        "model_entry": model_entry(config["models"][run["model"]]),
        "dataset_entry": config["datasets"][run["dataset"]],
        "reward_funcs": run.get("reward_funcs", []), "reward_model": run.get("reward_model"),
        "policy": run.get("policy"), "seed": run.get("seed", config["seed"]), "group": run.get("group", name),
        "distributed": run.get("distributed", distributed.DEFAULT),
        **({"sweep": run["sweep"], "swept": run["swept"]} if run.get("sweep") else {}),
        # Absent where false or unset, so the runs of configs without them keep their params (and results).
        **({"chat": True} if chat_prompts(config["models"][run["model"]], config["datasets"][run["dataset"]]) else {}),
        **({"eval_rows": run["eval_rows"]} if run.get("eval_rows") else {}),
    })


def _check_run_rewards(config: dict, runs: dict, name: str, run: dict, where: str) -> None:
    spec = REGISTRY[run["trainer"]]
    for key, trainer in (("reward_model", "reward"), ("policy", None)):
        ref = run.get(key)
        if not ref:
            continue
        if ref not in runs:
            raise ConfigError(f"config: {where}.{key}: no run named '{ref}'; runs are {sorted(runs)}")
        if trainer and runs[ref]["trainer"] != trainer:
            raise ConfigError(f"config: {where}.{key}: run '{ref}' trains '{runs[ref]['trainer']}', not a reward model")
    if spec.value_model and not run.get("reward_model"):
        raise ConfigError(f"config: {where}: ppo needs a reward_model (a run of the reward trainer, e.g. "
                          f"'reward-{{model}}')")
    if spec.reward_funcs and not (run.get("reward_funcs") or run.get("reward_model")):
        raise ConfigError(f"config: {where}: {run['trainer']} needs reward_funcs or a reward_model")
    if not spec.reward_funcs and run.get("reward_funcs"):
        raise ConfigError(f"config: {where}.reward_funcs: trainer '{run['trainer']}' takes no reward functions")
    for entry in run.get("reward_funcs", []):
        fname = entry if isinstance(entry, str) else entry["function"]
        if ":" not in fname and fname not in BUILTINS:
            raise ConfigError(f"config: {where}.reward_funcs: unknown reward function '{fname}'; expected one of "
                              f"{sorted(BUILTINS)} or 'package.module:function'")
    if spec.generation_check:
        check_generation_batch(run["trainer"], trl_args(config, run), where)


def trl_args(config: dict, run: dict) -> dict:
    """TRL config fields: shared training defaults < per-trainer args < per-run args."""
    return {**config.get("training", {}), **config["trainers"][run["trainer"]].get("args", {}), **run.get("args", {})}


def lora_args(config: dict, model: str) -> dict:
    return {**config.get("lora", {}), **config["models"][model].get("lora", {})}
