"""Config checks that JSON schema cannot express, and the run matrix.

Pure Python (no torch/transformers/trl): the Snakefile calls this at parse time.
"""

from __future__ import annotations

import copy
import os
import re
import string
from collections.abc import Callable
from pathlib import Path

from snaketrl import paths
from snaketrl.config.args import check_run_counts, checked
from snaketrl.config.sweeps import with_sweeps
from snaketrl.errors import ConfigError, close_match, closest, did_you_mean
from snaketrl.models.gguf import check_source
from snaketrl.rewards import BUILTINS
from snaketrl.train import distributed
from snaketrl.train.args import check_switches
from snaketrl.train.fields import module_source, top_level_names
from snaketrl.trainers import REGISTRY


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
        if best.validator == "additionalProperties" and isinstance(best.instance, dict):
            raise ConfigError(unknown_key(best.absolute_path, best.instance, best.schema)) from None
        if best.validator == "oneOf" and all("required" in alt for alt in best.validator_value):
            names = [f"'{alt['required'][0]}'" for alt in best.validator_value]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
            message = f"needs exactly one of {expected}"
        else:
            message = best.message
        raise ConfigError(f"config: {path}: {message}") from None


# Keys of a model's loading in other tools (transformers, bitsandbytes) and what does it here.
BNB = "use quantization: 4bit (the workflow sets bitsandbytes' nf4 with double quantization)"
MODEL_LOADING = {"load_in_4bit": BNB, "bnb_4bit_": BNB, "load_in_8bit": "use quantization: 8bit",
                 "quantization_config": "use quantization: 4bit or 8bit",
                 "torch_dtype": "the workflow loads weights in the hardware's dtype (bf16 on a bf16 GPU, else fp32)",
                 "dtype": "the workflow loads weights in the hardware's dtype (bf16 on a bf16 GPU, else fp32)"}


def unknown_key(at, instance: dict, schema: dict) -> str:
    """The message for a key the schema does not allow: the key path, and the key meant (a did-you-mean among
    the object's own keys, or what does here what another tool's key does)."""
    allowed = list(schema.get("properties", {}))
    key = next(str(k) for k in instance if k not in allowed)
    path = ".".join([*(str(p) for p in at), key])
    hint = next((v for k, v in MODEL_LOADING.items() if key == k or (k.endswith("_") and key.startswith(k))), None)
    if hint and "quantization" in allowed:  # a model entry
        return f"config: {path}: unknown key; {hint}"
    return f"config: {path}: unknown key{did_you_mean(key, allowed) or f'; expected one of {sorted(allowed)}'}"


def yaml_mistake(path: str) -> str | None:
    """A YAML mistake in a config file as one line naming the file, line and column (Snakemake's own message
    names neither), or None when the file reads. libyaml reads a good file in a millisecond; a bad one is
    read again by PyYAML's own parser, whose messages say more."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return None
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        pass
    try:
        with open(path, encoding="utf-8") as f:
            yaml.safe_load(f)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        start = err.context_mark
        context = (f" ({err.context} that started at line {start.line + 1})" if err.context and start and mark
                   and start.line != mark.line else "")
        hint = "; YAML indents with spaces, never tabs" if "\\t" in str(err.problem) else ""
        return f"config: {path}{where}: {err.problem}{context}{hint}"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return f"config: {path}: {err}"
    return None


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
    matrix_runs = [f"{t}-{m}" for t in matrix.get("trainers", []) for m in matrix.get("models", [])]
    for name, run in runs.items():
        for key in ("trainer", "model"):
            if key not in run:
                near = closest(name, matrix_runs)
                hint = f"; did you mean the matrix run '{near}'?" if near else ""
                raise ConfigError(f"config: runs.{name}: missing '{key}' (not a matrix run, so it must name one)"
                                  f"{hint}")
        defaults = config["trainers"].get(run["trainer"], {})
        for key in INHERITED:
            if key not in run and key in defaults:
                run[key] = copy.deepcopy(defaults[key])
        for key in ("reward_model", "policy"):
            if run.get(key):
                run[key] = with_model(run[key], run["model"], written_at(config, name, run, key))
    return runs


def with_model(ref: str, model: str, where: str) -> str:
    """A run reference with `{model}` (the run's model) filled in; any other placeholder is an error."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(ref) if f is not None]
    except ValueError as err:  # an unclosed or stray brace
        raise ConfigError(f"config: {where}: {ref!r}: {err}; the only placeholder is {{model}} (the run's "
                          f"model)") from None
    wrong = [f for f in fields if f != "model"]
    if wrong:
        raise ConfigError(f"config: {where}: {ref!r}: unknown placeholder {{{wrong[0]}}}; the only one is {{model}} "
                          f"(the run's model)")
    return ref.format(model=model)


INHERITED = ("dataset", "reward_funcs", "reward_model", "policy", "distributed", "processes", "eval_rows",
             "max_tokens")

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


def check(config: dict, shipped: Callable[[str], str] | None = None, gpus: int = 0) -> dict[str, dict]:
    """Cross-reference checks; returns every run fully resolved (see resolve_run). Errors name the key path.
    `shipped(rel)`: the path of a file that ships with the workflow (the Snakefile's; without it, files of the
    workflow are looked up from the working directory, as from the clone's root: see paths.from_config).
    `gpus`: the train rule's GPU count from the profile's or command line's resources (distributed.rule_gpus)."""
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
    config = checked(config, runs)  # TRL and LoRA fields, where they are written; values as the jobs take them
    runs = with_sweeps(config, expand_runs(config))
    for name, run in runs.items():
        where = f"runs.{name}" if name in config.get("runs", {}) else f"matrix (run {name})"
        if run.get("sweep"):
            where = f"sweeps.{run['trainer']} (run {name})"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.~+-]*", name):  # '~' and '+': swept values (snaketrl.config.sweeps)
            raise ConfigError(f"config: {where}: run name may hold only letters, digits, '_', '.', '~', '+', '-'")
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


def written_at(config: dict, name: str, run: dict, key: str) -> str:
    """The key path where a run's `key` is written: its `runs` entry (a swept run's: its un-swept run's), the
    matrix (trainer, model), or its trainer's entry (dataset, reward_funcs, policy, ...)."""
    base = run.get("sweep") or name
    if key in (config.get("runs") or {}).get(base, {}):
        return f"runs.{base}.{key}"
    if key in ("trainer", "model"):
        return f"matrix.{key}s"
    return f"trainers.{run['trainer']}.{key}"


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
    """Local files and directories of what the runs use (their models and datasets, the datasets a tiny model's
    corpus or the evaluation reads) must exist: say so now, not in a job."""
    used_models = {run["model"] for run in runs.values()}
    used_datasets = {run["dataset"] for run in runs.values()} | set(_evaluation_datasets(config))
    for name in sorted(used_models):
        if "tiny" in config["models"][name]:
            used_datasets |= {c for c in config["models"][name]["tiny"]["corpus"] if c in config["datasets"]}
    for name in sorted(used_datasets & set(config["datasets"])):
        entry = config["datasets"][name]
        for split, path in _written_files(entry).items():
            if not Path(paths.from_config(path, shipped)).is_file():
                raise ConfigError(f"config: datasets.{name}.files: {split} file {path} does not exist"
                                  f"{_where_looked(path, shipped)}")
        _check_local_hub(entry, f"datasets.{name}.hub")
    for name in sorted(used_models):
        if "tiny" in config["models"][name]:
            corpus_files(config, name, shipped)
        path = config["models"][name].get("gguf", {}).get("path")
        if path and not Path(paths.from_config(path, shipped)).is_file():
            raise ConfigError(f"config: models.{name}.gguf.path: {path} does not exist{_where_looked(path, shipped)}")
        _check_local_hub(config["models"][name], f"models.{name}.hub")


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
        # Only where it is more than 1: a one-process run's params (and resume fingerprint) stay as they were.
        **({"processes": run["processes"]} if run.get("processes", 1) > 1 else {}),
        **({"sweep": run["sweep"], "swept": run["swept"]} if run.get("sweep") else {}),
        # Absent where false or unset, so the runs of configs without them keep their params (and results).
        **({"chat": True} if chat_prompts(config["models"][run["model"]], config["datasets"][run["dataset"]]) else {}),
        **({"eval_rows": run["eval_rows"]} if run.get("eval_rows") else {}),
        **({"max_tokens": run["max_tokens"]} if run.get("max_tokens") else {}),
    })


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
        check_reward_func(entry if isinstance(entry, str) else entry["function"],
                          written_at(config, name, run, "reward_funcs"))
    if spec.generation_check:
        check_generation_batch(run["trainer"], trl_args(config, run), where)


def trl_args(config: dict, run: dict) -> dict:
    """TRL config fields: shared training defaults < per-trainer args < per-run args."""
    return {**config.get("training", {}), **config["trainers"][run["trainer"]].get("args", {}), **run.get("args", {})}


def lora_args(config: dict, model: str) -> dict:
    return {**config.get("lora", {}), **config["models"][model].get("lora", {})}


def check_reward_func(name: str, where: str) -> None:
    """A reward function's name: a built-in, or `package.module:function` whose module exists (found as the
    import system finds it, not run: a user's module may import torch) and defines the function."""
    if ":" not in name:
        if name not in BUILTINS:
            raise ConfigError(f"config: {where}: unknown reward function '{name}'{close_match(name, BUILTINS)}; "
                              f"expected one of {sorted(BUILTINS)} or 'package.module:function'")
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
