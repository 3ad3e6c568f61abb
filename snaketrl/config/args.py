"""TRL and LoRA fields written in the config, checked where they are written: each name against its config
class (read statically, snaketrl.config.fields), each value against the field's type and, for the counts that
make a run train nothing, its range. Values are returned as the job needs them: YAML 1.1 reads `1e-4` as the
string '1e-4' and `no` as false, which a numeric field, or one whose choices hold 'no', takes as meant.

Pure Python (no torch/transformers/trl/peft import): snaketrl.config.resolve_runs calls this at parse time.
"""

from __future__ import annotations

import re

from snaketrl.errors import ConfigError, did_you_mean
from snaketrl.train.args import OWNED
from snaketrl.config.fields import Field, init_field_types
from snaketrl.config.matrix import NAME, NAME_CHARS
from snaketrl.train.live import check_report_to
from snaketrl.trainers import REGISTRY

LORA = "peft:LoraConfig"
# LoRA fields the workflow sets from the trainer (SEQ_CLS for reward models, else CAUSAL_LM).
LORA_OWNED = {"task_type": "the trainer (SEQ_CLS for reward, CAUSAL_LM otherwise)"}
# peft annotates lora_alpha `int`, but scales by lora_alpha / r with any number.
LORA_TYPES = {"lora_alpha": Field(frozenset({"int", "float"}))}

NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
# What YAML 1.1 reads as a boolean, and that a field of string choices may mean ('no' of eval_strategy).
YAML_BOOLS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


def _above(low, what=""):
    return lambda v: v > low, f"> {low}{what}"


def _at_least(low, what=""):
    return lambda v: v >= low, f">= {low}{what}"


# Values out of these ranges make a run train nothing, or fail inside TRL: (test, what is expected).
STEPS = (lambda v: v > 0 and (v <= 1 or v == int(v)),
         "> 0 (up to 1: a share of the training steps; above 1: a whole number of steps)")
LIMITS = {
    "num_train_epochs": _at_least(0, " (0 trains nothing unless max_steps is set)"),
    "max_steps": (lambda v: v == -1 or v >= 1, "a positive integer, or -1 (the default: num_train_epochs decides)"),
    "learning_rate": _at_least(0),
    "logging_steps": STEPS, "eval_steps": STEPS, "save_steps": STEPS,
    "warmup_steps": _at_least(0),
    "num_generations": _at_least(2, " (group-relative advantages need at least two completions per prompt)"),
    "temperature": _above(0),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "dataloader_num_workers": _at_least(0),
    **{key: _at_least(1) for key in (
        "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
        "eval_accumulation_steps", "max_completion_length", "generation_batch_size",
        "steps_per_generation", "num_iterations", "num_generations_eval", "total_episodes", "response_length",
        "num_ppo_epochs", "num_mini_batches", "local_rollout_forward_batch_size")},
}
LORA_LIMITS = {"r": _at_least(1), "lora_alpha": _above(0), "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)")}

MAX_SHOWN = 12  # choices a message lists (transformers has 41 optimizers)
WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "none": "null",
         "dict": "a mapping", "list": "a list"}


def class_name(dotted: str) -> str:
    """How a message names a config class: trl.SFTConfig, trl.experimental.ppo.PPOConfig, peft.LoraConfig."""
    return dotted.replace(":", ".")


def value(field: Field, v, where: str):
    """`v` as the field takes it (a numeric string as its number, an integral float of an int field as the
    int), or a ConfigError naming `where`, the value and what was expected."""
    types = field.types
    if types is None or any(v is x and type(v) is type(x) for x in field.values):
        return v
    if isinstance(v, str) and v in field.values:
        return v
    if v is None:
        if "none" in types:
            return v
    elif isinstance(v, bool):
        if "bool" in types:
            return v
        meant = next((word for word in YAML_BOOLS[v] if word in field.values), None)
        if meant:  # YAML 1.1 reads `eval_strategy: no` as false
            return meant
    elif isinstance(v, (int, float)):
        number = _number(types, v)
        if number is not None:
            return number
    elif isinstance(v, str):
        if "str" in types:
            return v
        if NUMBER.fullmatch(v.strip()):
            number = _number(types, float(v))
            if number is not None:
                return number
    elif isinstance(v, dict):
        if "dict" in types:
            return v
    elif isinstance(v, (list, tuple)):
        if "list" in types:
            return v
    if "list" in types:  # TRL takes one item for a list of one (loss_type: sigmoid, report_to: none)
        return v
    raise ConfigError(f"config: {where}: expected {expected(field)}, got {shown(v)}"
                      f"{did_you_mean(v, [c for c in field.values if isinstance(c, str)]) if isinstance(v, str) else ''}")


def _number(types, v):
    if "int" in types and float(v).is_integer():
        return int(v)
    if "float" in types:
        return v
    return None


def expected(field: Field) -> str:
    words = [WORDS[t] for t in WORDS if t in field.types and not (t == "int" and "float" in field.types)]
    strings = [c for c in field.values if isinstance(c, str)]
    if strings:
        shown = ", ".join(repr(c) for c in strings[:MAX_SHOWN])
        words.insert(0, f"one of {shown}" + (f", ... ({len(strings)} in all)" if len(strings) > MAX_SHOWN else ""))
    words += [shown(c) for c in field.values if not isinstance(c, str)]
    return " or ".join(words)


def shown(v) -> str:
    """A value as YAML writes it where Python's repr differs (true, false, null)."""
    if v is None:
        return "null"
    return ("true" if v else "false") if isinstance(v, bool) else repr(v)


def _check_range(field: Field, key: str, v, where: str, limits: dict) -> None:
    if key in limits and isinstance(v, (int, float)) and not isinstance(v, bool):
        test, what = limits[key]
        if not test(v):
            if what.startswith((">", "in ")):  # "an integer >= 1"
                what = f"{expected(Field(field.types - {'none'}))} {what}"
            raise ConfigError(f"config: {where}: expected {what}, got {shown(v)}")


def check_field(dotted: str, key: str, v, where: str, trainers_of=None):
    """One TRL field of a trainer's config class `dotted`, written at `where`: its name, whether the workflow
    owns it, its type and range; returns the value as the job takes it. `trainers_of`: for `training`, the
    other trainers' classes, to say where a field of only some of them belongs."""
    if key in OWNED:
        raise ConfigError(f"config: {where}: set by {OWNED[key]}; remove it")
    if key.endswith("_token") and key.startswith(("hub", "push_to_hub")):  # a secret would reach manifests
        raise ConfigError(f"config: {where}: secrets do not belong in config; set HF_TOKEN in the environment")
    fields = init_field_types(dotted)
    if fields is None:  # not readable here: the train job's check_args names it
        return v
    if key not in fields:
        others = sorted(t for t, d in (trainers_of or {}).items() if key in (init_field_types(d) or {}))
        hint = (f" (training applies to every trainer; set it under trainers.<name>.args of {', '.join(others)})"
                if others else did_you_mean(key, fields))
        raise ConfigError(f"config: {where}: not a field of {class_name(dotted)}{hint}")
    if key == "bf16" and v:
        raise ConfigError(f"config: {where}: the hardware decides bf16 (on where the GPU supports it); only "
                          f"bf16: false may be set")
    v = value(fields[key], v, where)
    _check_range(fields[key], key, v, where, LIMITS)
    if key == "report_to":
        check_report_to(v, where)
    return v


def check_section(section: dict, trainers: list[str], where: str) -> dict:
    """A mapping of TRL fields (`training`, `trainers.<t>.args`, `runs.<r>.args`) that reaches the config
    classes of `trainers`; returns it with each value as the jobs take it."""
    classes = {t: REGISTRY[t].config for t in trainers}
    out = {}
    for key, v in section.items():
        if key == "project" and where != "training":
            raise ConfigError(f"config: {where}.project: one trackio project holds all the workflow's runs; "
                              f"set project under training")
        if key == "project" and not (isinstance(v, str) and NAME.fullmatch(v)):
            raise ConfigError(f"config: training.project: {v!r}: the trackio project names a file in "
                              f"results/trackio; it may hold only {NAME_CHARS}")
        for trainer in trainers:
            others = {t: d for t, d in classes.items() if t != trainer} if where == "training" else None
            out[key] = check_field(classes[trainer], key, v, f"{where}.{key}", others)
    return {**section, **out}


def check_lora(section: dict, where: str) -> dict:
    """peft.LoraConfig fields (`lora`, `models.<m>.lora`); returns them as the jobs take them."""
    fields = init_field_types(LORA)
    out = {}
    for key, v in section.items():
        at = f"{where}.{key}"
        if key in LORA_OWNED:
            raise ConfigError(f"config: {at}: set by {LORA_OWNED[key]}; remove it")
        if fields is None:
            out[key] = v
            continue
        if key not in fields:
            raise ConfigError(f"config: {at}: not a field of {class_name(LORA)}{did_you_mean(key, fields)}")
        field = LORA_TYPES.get(key, fields[key])
        out[key] = value(field, v, at)
        _check_range(field, key, out[key], at, LORA_LIMITS)
    return out


def checked(config: dict, runs: dict[str, dict]) -> tuple[dict, dict[str, dict]]:
    """A copy of the config whose TRL and LoRA fields (`training`, `trainers.<t>.args`, `runs.<r>.args`,
    `lora`, `models.<m>.lora`) are checked where they are written and hold the values the jobs take, and `runs`
    (expand_runs(config): the trainer of each `runs` entry, the trainers `training` reaches) with those values."""
    # An unknown trainer of a run is named by the config check's own loop.
    used = sorted({run["trainer"] for run in runs.values()} & set(REGISTRY))
    out = {**config, "training": check_section(config.get("training") or {}, used, "training")}
    out["trainers"] = {t: {**entry, "args": check_section(entry.get("args") or {}, [t], f"trainers.{t}.args")}
                       for t, entry in config["trainers"].items()}
    out["runs"] = {name: {**entry, "args": check_section(entry.get("args") or {}, [runs[name]["trainer"]],
                                                          f"runs.{name}.args")}
                   for name, entry in (config.get("runs") or {}).items() if runs[name]["trainer"] in REGISTRY}
    out["lora"] = check_lora(config.get("lora") or {}, "lora")
    out["models"] = {m: {**entry, "lora": check_lora(entry.get("lora") or {}, f"models.{m}.lora")}
                     for m, entry in config["models"].items()}
    runs = {name: {**run, "args": {**run["args"], **out["runs"][name]["args"]}} if name in out["runs"] else run
            for name, run in runs.items()}
    return out, runs


def origin(config: dict, name: str, run: dict, key: str) -> str:
    """Where a run's TRL field is written: its sweep, its `runs` entry, its trainer's args, or `training`."""
    if key in (run.get("swept") or {}):
        return f"sweeps.{run['trainer']}.{key}"
    base = run.get("sweep") or name
    if key in ((config.get("runs") or {}).get(base) or {}).get("args", {}):
        return f"runs.{base}.args.{key}"
    if key in config["trainers"][run["trainer"]].get("args", {}):
        return f"trainers.{run['trainer']}.args.{key}"
    return f"training.{key}"


def check_run_counts(config: dict, name: str, run: dict, args: dict) -> None:
    """What only the merged args show: no epochs and no max_steps train nothing."""
    if args.get("num_train_epochs") == 0 and args.get("max_steps", -1) < 1:
        raise ConfigError(f"config: {origin(config, name, run, 'num_train_epochs')}: 0 epochs without max_steps "
                          f"trains nothing (run {name}); expected a number > 0")
