"""Cross-checks the JSON schema cannot express, and the runs they leave: `resolve_runs` is the config's one
entry point at parse time (the Snakefile's), every error one line naming its key path.

Pure Python (no torch/transformers/trl): the Snakefile calls this at parse time.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path

from snaketrl import paths
from snaketrl.config.args import check_run_counts, checked, origin
from snaketrl.config.fields import module_source, top_level_names
from snaketrl.config.files import chat_template_file, corpus_files, where_looked, written_files
from snaketrl.config.matrix import NAME, NAME_CHARS, expand_runs, with_seeds, written_at
from snaketrl.config.resolve import batching_of, resolve_run, trl_args
from snaketrl.config.sweeps import with_sweeps
from snaketrl.errors import ConfigError, close_match, did_you_mean
from snaketrl.models import chat_template
from snaketrl.models.gguf import MAGIC, check_source
from snaketrl.rewards import BUILTINS
from snaketrl.train import distributed
from snaketrl.train.args import check_switches
from snaketrl.trainers import REGISTRY




def resolve_runs(config: dict, shipped: Callable[[str], str] | None = None, gpus: int = 0) -> dict[str, dict]:
    """Every run the config asks for, checked and resolved (resolve_run), one per seed; any mistake is a
    ConfigError naming its key path. `shipped(rel)`: the path of a file that ships with the workflow (the
    Snakefile's; without it, files of the workflow are looked up from the working directory, as from the clone's
    root: see paths.from_config). `gpus`: the train rule's GPU count from the profile's or command line's
    resources (distributed.rule_gpus)."""
    known = sorted(REGISTRY)
    for pool, what in (("models", "model"), ("datasets", "dataset")):
        for name in config[pool]:
            if not NAME.fullmatch(name):
                raise ConfigError(f"config: {pool}.{name}: a {what} name names folders under results/; it may hold "
                                  f"only {NAME_CHARS}")
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
    # TRL and LoRA fields checked where they are written; values as the jobs take them.
    config, runs = checked(config, runs)
    runs = with_sweeps(config, runs)
    for name, run in runs.items():
        where = f"runs.{name}" if name in config.get("runs", {}) else f"matrix (run {name})"
        if run.get("sweep"):
            where = f"sweeps.{run['trainer']} (run {name})"
        if not NAME.fullmatch(name):
            raise ConfigError(f"config: {where}: run name may hold only {NAME_CHARS}")
        if run["trainer"] not in REGISTRY:
            raise ConfigError(f"config: {written_at(config, name, run, 'trainer')}: unknown trainer "
                              f"'{run['trainer']}'{close_match(run['trainer'], known)}; expected one of {known}")
        if run["trainer"] not in config["trainers"]:
            raise ConfigError(f"config: {written_at(config, name, run, 'trainer')}: trainer '{run['trainer']}' has "
                              f"no entry under trainers (it needs at least its dataset)")
        for key, pool in (("model", "models"), ("dataset", "datasets")):
            if run[key] not in config[pool]:
                raise ConfigError(f"config: {written_at(config, name, run, key)}: unknown {key} '{run[key]}'"
                                  f"{close_match(run[key], config[pool])}; expected one of {sorted(config[pool])}")
        _check_run_rewards(config, runs, name, run, where)
        distributed.check(config, name, run, where, shipped, gpus)
        check_run_counts(config, name, run, trl_args(config, run))
        _check_run_batching(config, run, where)
        _check_max_tokens(config, name, run)
        if run.get("max_flops") is not None:
            run["max_flops"] = max_flops(run["max_flops"], f"{written_at(config, name, run, 'max_flops')} (run {name})")
        _check_vllm(config, name, run)
        check_switches(run["trainer"], trl_args(config, run), where, run["model"], config["models"][run["model"]])
    for name, model in config["models"].items():
        if "gguf" in model:
            check_source(name, model["gguf"])
        chat_template.check(name, model)
        if not model.get("lora", {}).get("target_modules") and not config["lora"].get("target_modules"):
            raise ConfigError(f"config: models.{name}.lora.target_modules: missing; LoRA targets differ per "
                              f"architecture (q_proj,k_proj,v_proj for Qwen2/Llama, query_key_value for GPT-NeoX)")
    _check_batching(config, {run["trainer"] for run in runs.values()})
    _check_local_files(config, runs, shipped)
    seeded = with_seeds(config, runs)
    return {name: resolve_run(config, name, run, config["models"][seeded[run["reward_model"]]["model"]]
                              if run.get("reward_model") else None) for name, run in seeded.items()}


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
    """padding_free works only where TRL applies it (the batching fields themselves are the length stage's:
    snaketrl.config.args refuses them where they are written)."""
    args = trl_args(config, run)
    if args.get("padding_free"):
        if run["trainer"] != "sft":
            raise ConfigError(f"config: {where}: padding_free: TRL 1.12 applies it only in SFT (its DPO falls back "
                              f"to padding); length.batching: grouped pads each batch only to its neighbours")
        if batching_of(config, "sft") != "packed":
            raise ConfigError(f"config: {where}: padding_free: TRL 1.12 needs packing with it when max_length is "
                              f"set (the length histogram sets it); set length.batching to packed for sft")


def _check_vllm(config: dict, name: str, run: dict) -> None:
    """use_vllm passes through to TRL (its colocate mode by default: vLLM generates on the train job's GPU) where
    vllm imports; where it does not, the run is refused now rather than in its job."""
    import importlib.util

    if trl_args(config, run).get("use_vllm") and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"config: {origin(config, name, run, 'use_vllm')}: use_vllm needs the vllm package, which "
                          f"this environment lacks (pip install vllm, on a machine with a CUDA GPU); without it, "
                          f"drop use_vllm: TRL then generates with transformers")


def _check_max_tokens(config: dict, name: str, run: dict) -> None:
    """max_tokens sets max_steps from the length stage's tokens per example: a trainer with a dataset of whole
    examples, and never beside a max_steps of the run's own."""
    if not run.get("max_tokens"):
        return
    at = f"{written_at(config, name, run, 'max_tokens')} (run {name})"
    if REGISTRY[run["trainer"]].length_field is None:
        raise ConfigError(f"config: {at}: {run['trainer']} generates its completions, so its tokens per step are not "
                          f"known before training; bound it with args.max_steps")
    if "max_steps" in trl_args(config, run):
        raise ConfigError(f"config: {at}: max_tokens sets max_steps; the run also sets args.max_steps: keep one")


def max_flops(value, at: str) -> float:
    """A run's max_flops as a number: YAML 1.1 reads 1.0e12 and 1e12 as text (only 1.0e+12 as a float), so
    such text is read here; anything else but a positive finite number is refused."""
    import math

    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise ConfigError(f"config: {at}: max_flops must be a positive number of FLOPs, such as 1.0e12 (got "
                          f"{value!r})")
    return float(number)


def _check_run_rewards(config: dict, runs: dict, name: str, run: dict, where: str) -> None:
    spec = REGISTRY[run["trainer"]]
    for key, kind in (("reward_model", "reward model runs"), ("policy", "language-model runs")):
        ref = run.get(key)
        if not ref:
            continue
        # Only runs of the right kind are suggested: a policy trains a language model, a reward model is one.
        fits = sorted(n for n, r in runs.items() if (r["trainer"] == "reward") == (key == "reward_model"))
        at = f"{written_at(config, name, run, key)} (run {name})"
        if ref not in runs:
            raise ConfigError(f"config: {at}: no run named '{ref}'{close_match(ref, fits)}; {kind} are {fits}")
        if key == "reward_model" and runs[ref]["trainer"] != "reward":
            raise ConfigError(f"config: {at}: run '{ref}' trains '{runs[ref]['trainer']}', not a reward model")
    if spec.value_model and not run.get("reward_model"):
        raise ConfigError(f"config: {where}: ppo needs a reward_model (a run of the reward trainer, e.g. "
                          f"'reward-{{model}}')")
    if spec.reward_funcs and not (run.get("reward_funcs") or run.get("reward_model")):
        raise ConfigError(f"config: {where}: {run['trainer']} needs reward_funcs or a reward_model")
    if not spec.reward_funcs and run.get("reward_funcs"):
        raise ConfigError(f"config: {written_at(config, name, run, 'reward_funcs')}: trainer '{run['trainer']}' "
                          f"takes no reward functions")
    for entry in run.get("reward_funcs", []):
        check_reward_func(entry, written_at(config, name, run, "reward_funcs"))
    if spec.generation_check:
        check_generation_batch(run["trainer"], trl_args(config, run), where)


def check_reward_func(entry, where: str) -> None:
    """A reward function entry (a name, or {function, kwargs}): a built-in with arguments it takes and accepts, or
    `package.module:function` whose module exists (found as the import system finds it, not run: a user's module
    may import torch) and defines the function."""
    name = entry if isinstance(entry, str) else entry["function"]
    if ":" not in name:
        if name not in BUILTINS:
            raise ConfigError(f"config: {where}: unknown reward function '{name}'{close_match(name, BUILTINS)}; "
                              f"expected one of {sorted(BUILTINS)} or 'package.module:function'")
        check_builtin_kwargs(name, {} if isinstance(entry, str) else entry.get("kwargs") or {}, where)
        return
    module, _, func = name.partition(":")
    found = module_source(module)
    if found is None:
        raise ConfigError(f"config: {where}: '{name}': no module '{module}' on the Python path (install it, or "
                          f"put its directory on PYTHONPATH)")
    names = top_level_names(found[1])
    if names is not None and func not in names:
        raise ConfigError(f"config: {where}: '{name}': module '{module}' ({found[0]}) defines no '{func}'"
                          f"{did_you_mean(func, names)}")


def check_builtin_kwargs(name: str, kwargs: dict, where: str) -> None:
    """A built-in's kwargs: only the settings it has (its arguments with defaults; the others are data columns),
    with values it accepts. Each built-in checks its settings before scoring anything, so scoring no completion
    checks them here rather than in the first training step."""
    func = BUILTINS[name]
    settings = [p.name for p in inspect.signature(func).parameters.values()
                if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty]
    for key in kwargs:
        if key not in settings:
            raise ConfigError(f"config: {where}: {name}: unknown kwargs key '{key}'{close_match(key, settings)}; "
                              f"{name} takes {settings or 'no kwargs'}")
    try:
        func([], answer=[], prompts=[], **kwargs)
    except ConfigError as err:  # the built-in's own message, placed at the entry's key
        raise ConfigError(str(err).replace("config: reward_funcs:", f"config: {where}:", 1)) from None


def _check_local_files(config: dict, runs: dict, shipped=None) -> None:
    """Local files and directories of what the runs use (their models and datasets, the datasets a tiny model's
    corpus or the evaluation reads) must exist: say so now, not in a job."""
    used_models = {run["model"] for run in runs.values()}
    used_datasets = {run["dataset"] for run in runs.values()} | set(_evaluation_datasets(config))
    for name in sorted(used_models):
        if "tiny" in config["models"][name]:
            used_datasets |= {c for c in config["models"][name]["tiny"]["corpus"] if c in config["datasets"]}
    for name in sorted(used_datasets & set(config["datasets"])):
        entry = config["datasets"][name]
        for split, path in written_files(entry).items():
            if not Path(paths.from_config(path, shipped)).is_file():
                raise ConfigError(f"config: datasets.{name}.files: {split} file {path} does not exist"
                                  f"{where_looked(path, shipped)}")
        _check_local_hub(entry, f"datasets.{name}.hub")
    for name in sorted(used_models):
        if "tiny" in config["models"][name]:
            corpus_files(config, name, shipped)
        _check_gguf_paths(name, config["models"][name].get("gguf", {}).get("path"), shipped)
        _check_local_hub(config["models"][name], f"models.{name}.hub")
        _check_template_source(name, config["models"][name], shipped)


def _check_gguf_paths(name: str, path, shipped) -> None:
    """A local GGUF file, or its parts: each exists, and only the first starts a GGUF file (the parts are named
    in their order)."""
    parts = path if isinstance(path, list) else [path] if path else []
    for i, part in enumerate(parts):
        local = Path(paths.from_config(part, shipped))
        if not local.is_file():
            what = f"part {i + 1} of {len(parts)}, " if len(parts) > 1 else ""
            raise ConfigError(f"config: models.{name}.gguf.path: {what}{part} does not exist"
                              f"{where_looked(part, shipped)}")
        if len(parts) > 1:
            with open(local, "rb") as f:
                starts = f.read(len(MAGIC)) == MAGIC
            if starts != (i == 0):
                raise ConfigError(f"config: models.{name}.gguf.path: part {i + 1} of {len(parts)}, {part}, "
                                  f"{'does not start' if i == 0 else 'starts'} a GGUF file; name the parts in their "
                                  f"order, the file's first part first")


def _check_template_source(name: str, entry: dict, shipped) -> None:
    """A chat template from a local Jinja file or tokenizer directory: it exists."""
    local = chat_template_file(entry, shipped).get("chat_template")
    if local is None:
        return
    wanted = "file" if chat_template.kind(entry["chat_template"]) == "file" else "directory"
    if not (Path(local).is_file() if wanted == "file" else Path(local).is_dir()):
        written = entry["chat_template"]
        raise ConfigError(f"config: models.{name}.chat_template: {wanted} {written} does not exist"
                          f"{where_looked(written, shipped)}")


def _evaluation_datasets(config: dict) -> list[str]:
    ev = config.get("evaluation") or {}
    return [d if isinstance(d, str) else d.get("dataset") for d in (ev.get(k) for k in ("prompts", "references",
                                                                                         "pairs")) if d]


def _check_local_hub(entry: dict, where: str) -> None:
    """A `hub:` written as a local path (absolute, ./, ../, ~) names a directory, not a Hub id: it must exist."""
    repo = entry.get("hub")
    if repo and repo.startswith(("/", "./", "../", "~")) and not Path(repo).expanduser().is_dir():
        relative = f", read from the working directory {os.getcwd()}" if repo.startswith(".") else ""
        raise ConfigError(f"config: {where}: local directory {repo} does not exist{relative} (a Hub id is written "
                          f"org/name)")
