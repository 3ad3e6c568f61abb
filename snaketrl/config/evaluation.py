"""The `evaluation:` config section, checked at parse time; which eval jobs exist and what each reads.

Pure Python (no torch, transformers, trl or lm_eval import): the Snakefile calls this while parsing.
snaketrl.evaluate does the work in the jobs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

from snaketrl import paths
from snaketrl.config.checks import check_reward_func
from snaketrl.config.resolve import chat_model, chat_prompts
from snaketrl.data.preprocess import LAYOUTS
from snaketrl.errors import ConfigError, close_match
from snaketrl.evaluate.harness import check_lm_eval_tasks
from snaketrl.evaluate.kinds import (JUDGE_PROMPTS, KINDS, judge_chat, judge_prompt_sets, reward_func_name,
                                     score_name)
from snaketrl.remote_code import TRUSTED_JUDGES, param, trusted
from snaketrl.trainers import REGISTRY

# Columns a `format` conversion produces (snaketrl.data.formats.FORMATS).
FORMAT_COLUMNS = {"alpaca": ("prompt", "completion"), "hh": ("prompt", "chosen", "rejected")}


DEFAULTS = {
    "runs": None,
    "prompts": None,
    "references": None,
    "pairs": None,
    "generation": {"max_new_tokens": 64, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "batch_size": 16},
    "batch_size": 16,
    "reward_funcs": [],
    "reward_models": [],
    "lm_eval": {"tasks": [], "limit": None, "batch_size": 8, "num_fewshot": None},
}


KIND_DEFAULTS = {"split": "eval", "size": None}


BASE_PREFIX = "base-"


def data_trainer(kind: str) -> str:
    """The trainer whose preprocessing gives a kind's rows (the prepared file the eval job reads):
    the first registered trainer with the kind's layout (prompts: grpo, references: sft, pairs: dpo)."""
    layout = KINDS[kind]["layout"]
    return next(name for name, spec in REGISTRY.items() if spec.layout == layout)


def check_evaluation(section: dict | None, runs: dict[str, dict], datasets: dict[str, dict],
                     shipped: Callable[[str], str] | None = None) -> dict | None:
    """The `evaluation:` section checked against the runs (snaketrl.config.resolve_runs's result) and the
    datasets (config["datasets"]), with defaults filled. None when there is no section. `shipped`: where the
    workflow's own files are (paths.from_config), to read the first row of a `workflow:` dataset file.
    Raises a one-line ConfigError naming the key."""
    if not section:
        return None
    ev = _with_defaults(section)
    where = "config: evaluation"

    causal = sorted(n for n, r in runs.items() if REGISTRY[r["trainer"]].task_type == "CAUSAL_LM")
    if ev["runs"] is None:
        ev["runs"] = causal
    # A run repeated over seeds may be named by its group, a swept run by its un-swept name: evaluate every
    # member; judge with the first. A group beats a sweep of the same name (the run kept un-swept as a reference).
    members, swept = {}, {}
    for n, r in sorted(runs.items(), key=lambda kv: (kv[1].get("seed", 0), kv[0])):
        members.setdefault(r.get("group", n), []).append(n)
        if r.get("sweep"):
            swept.setdefault(r["sweep"], []).append(n)
    members = {**swept, **members}
    ev["runs"] = [m for n in ev["runs"] for m in (members.get(n, [n]) if n not in runs else [n])]
    own = _judge_entries(ev)
    ev["reward_models"] = [n if n in runs else members.get(n, [n])[0] for n in ev["reward_models"]]
    for name in ev["runs"]:
        if name not in runs:
            raise ConfigError(f"{where}.runs: no run named '{name}'{close_match(name, [*causal, *members])}; "
                              f"language-model runs are {causal}")
        if name not in causal:
            raise ConfigError(f"{where}.runs: run '{name}' trains a reward model ({runs[name]['trainer']}), which "
                              f"generates nothing; list it under evaluation.reward_models to judge with it")
    for name in [*runs, *ev["runs"]]:
        if name.startswith(BASE_PREFIX) and name[len(BASE_PREFIX):] in {r["model"] for r in runs.values()}:
            raise ConfigError(f"{where}: run name '{name}' is taken by the evaluation of base model "
                              f"'{name[len(BASE_PREFIX):]}'; rename the run")

    reward_runs = sorted(n for n, r in runs.items() if r["trainer"] == "reward")
    for name in ev["reward_models"]:
        if name not in runs:
            known = (f"reward model runs are {reward_runs}" if reward_runs else
                     "no run trains a reward model (add reward to matrix.trainers, or leave reward_models out)")
            raise ConfigError(f"{where}.reward_models: '{name}' is not a run{close_match(name, reward_runs)}; {known}")
        if runs[name]["trainer"] != "reward":
            raise ConfigError(f"{where}.reward_models: run '{name}' trains '{runs[name]['trainer']}', not a reward "
                              f"model; reward model runs are {reward_runs}")

    names = []
    for entry in ev["reward_funcs"]:
        fname = reward_func_name(entry)
        check_reward_func(entry, "evaluation.reward_funcs")
        names.append(score_name("fn", fname))
    names += [score_name("rm", n) for n in ev["reward_models"]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{where}: two scores would both be named '{dupes[0]}' (reward_funcs and reward_models "
                          f"must have distinct names)")

    for kind in KINDS:
        if ev[kind] is not None:
            check_dataset(ev[kind], kind, datasets, f"{where}.{kind}", shipped)
    _check_generation(ev["generation"], f"{where}.generation")
    judged = _judge_prompts(own, ev, runs, datasets, where, shipped)
    if judged:  # absent where no reward model names its prompts: those configs' eval jobs keep their params
        ev[JUDGE_PROMPTS] = judged
    if ev["prompts"] is None and (ev["reward_funcs"] or set(ev["reward_models"]) - set(judged)):
        raise ConfigError(f"{where}: reward_funcs/reward_models score generated completions; set "
                          f"evaluation.prompts.dataset")
    if not any(ev[k] for k in KINDS) and not ev["lm_eval"]["tasks"] and not judged:
        raise ConfigError(f"{where}: nothing to evaluate; set prompts, references, pairs or lm_eval.tasks")

    check_lm_eval_tasks(ev["lm_eval"]["tasks"], f"{where}.lm_eval.tasks")
    return ev


def _check_generation(gen: dict, key: str) -> None:
    for name in ("max_new_tokens", "batch_size"):
        if not isinstance(gen[name], int) or isinstance(gen[name], bool) or gen[name] < 1:
            raise ConfigError(f"{key}.{name}: expected a positive integer, got {gen[name]!r}")
    if gen["do_sample"] and not gen["temperature"] > 0:
        raise ConfigError(f"{key}.temperature: expected > 0 when sampling, got {gen['temperature']!r}")


# Where the checked section keeps the reward models that judge their own prompts: run -> those prompts
# ({dataset, split, size, trainer, [chat], generation}), in evaluation.reward_models order.
JUDGE_KEYS = ("run", "prompts", "generation")


def _judge_entries(ev: dict) -> list[tuple[int, dict]]:
    """The `{run, prompts, generation}` entries of evaluation.reward_models (index, entry), each checked for its
    keys; ev["reward_models"] becomes the list of run names."""
    own, names = [], []
    for i, entry in enumerate(ev["reward_models"]):
        key = f"config: evaluation.reward_models[{i}]"
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - set(JUDGE_KEYS))
            if unknown:
                raise ConfigError(f"{key}.{unknown[0]}: unknown key; expected one of {list(JUDGE_KEYS)}")
            if not isinstance(entry.get("run"), str):
                raise ConfigError(f"{key}.run: expected the name of a reward model run, got {entry.get('run')!r}")
            if entry.get("prompts") is None:
                raise ConfigError(f"{key}.prompts: expected the prompts it judges, a dataset name or {{dataset, split, "
                                  f"size}} (a run name alone judges the yardstick's prompts)")
            own.append((i, entry))
            entry = entry["run"]
        names.append(entry)
    ev["reward_models"] = names
    return own


def _judge_prompts(own: list[tuple[int, dict]], ev: dict, runs: dict, datasets: dict, where: str,
                   shipped=None) -> dict:
    """Each reward model that names its own prompts (the eval split's first `size` rows of a dataset, as
    evaluation.prompts takes them): run -> those prompts checked, with the generation they are completed with
    (evaluation.generation, overridden by the entry's). One dataset is one set of prompts: two reward models
    judging the same dataset must name it alike. Their rows are the prepared split of a run that trains on that
    dataset in the prompts' layout (PPO's, for its reward model's prompts; preprocessing reads the layout, not the
    trainer, so the rows are the same and no job is added), else data_trainer's."""
    judged, by_dataset = {}, {}
    for i, entry in own:
        key = f"{where}.reward_models[{i}]"
        prompts = entry["prompts"]
        prompts = copy.deepcopy({"dataset": prompts} if isinstance(prompts, str) else prompts)
        if not isinstance(prompts, dict):
            raise ConfigError(f"{key}.prompts: expected a dataset name or {{dataset, split, size}}, got {prompts!r}")
        unknown = sorted(set(prompts) - {"dataset", *KIND_DEFAULTS})
        if unknown:
            raise ConfigError(f"{key}.prompts.{unknown[0]}: unknown key; expected one of ['dataset', 'split', 'size']")
        prompts = {**KIND_DEFAULTS, **prompts}
        check_dataset(prompts, "prompts", datasets, f"{key}.prompts", shipped)
        trains = {r["trainer"] for r in runs.values() if r.get("dataset") == prompts["dataset"]}
        prompts["trainer"] = next((t for t, spec in REGISTRY.items() if t in trains
                                   and spec.layout == KINDS["prompts"]["layout"]), prompts["trainer"])
        extra = entry.get("generation") or {}
        if not isinstance(extra, dict) or set(extra) - set(DEFAULTS["generation"]):
            bad = sorted(set(extra) - set(DEFAULTS["generation"])) if isinstance(extra, dict) else None
            raise ConfigError(f"{key}.generation" + (f".{bad[0]}: unknown key" if bad else ": expected a mapping")
                              + f"; expected one of {sorted(DEFAULTS['generation'])}")
        prompts["generation"] = {**ev["generation"], **extra}
        _check_generation(prompts["generation"], f"{key}.generation")
        first = by_dataset.setdefault(prompts["dataset"], (i, prompts))
        if first[1] != prompts:
            raise ConfigError(f"{key}.prompts: dataset '{prompts['dataset']}' is judged on other prompts by "
                              f"evaluation.reward_models[{first[0]}]; give both the same split, size and generation")
        run = ev["reward_models"][i]
        if run in judged:
            raise ConfigError(f"{key}: reward model '{entry['run']}' is listed twice")
        judged[run] = prompts
    return judged


def _with_defaults(section: dict) -> dict:
    ev = copy.deepcopy(DEFAULTS)
    for key, value in section.items():
        if key not in DEFAULTS:
            raise ConfigError(f"config: evaluation.{key}: unknown key; expected one of {sorted(DEFAULTS)}")
        if isinstance(DEFAULTS[key], dict) and isinstance(value, dict):
            ev[key] = {**DEFAULTS[key], **copy.deepcopy(value)}
        else:
            ev[key] = copy.deepcopy(value)
    for kind in KINDS:
        if isinstance(ev[kind], str):  # shorthand: `prompts: tldr`
            ev[kind] = {"dataset": ev[kind]}
        if ev[kind] is not None:
            ev[kind] = {**KIND_DEFAULTS, **ev[kind]}
    return ev


def check_dataset(entry: dict, kind: str, datasets: dict, key: str, shipped=None) -> None:
    """One evaluation dataset entry ({dataset, split, size}, defaults filled) of a kind (KINDS), at config key
    `key`: a known dataset with the columns the kind needs, a split, a size. Adds the trainer whose prepared
    rows it reads, and the dataset's `chat` where set."""
    name = entry.get("dataset")
    if name not in datasets:
        raise ConfigError(f"{key}.dataset: unknown dataset {name!r}; expected one of {sorted(datasets)}")
    if entry["split"] not in ("train", "eval"):
        raise ConfigError(f"{key}.split: expected 'eval' (held out from training) or 'train', "
                          f"got {entry['split']!r}")
    size = entry["size"]
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"{key}.size: expected a positive integer or null, got {size!r}")
    entry["trainer"] = data_trainer(kind)
    if "chat" in datasets[name]:  # only where set: eval_targets decides per model (snaketrl.config.resolve.chat_prompts)
        entry["chat"] = datasets[name]["chat"]
    present = _first_row_columns(datasets[name], shipped)
    if present is None:  # a Hub dataset or a non-JSONL file: the eval job checks its rows
        return
    missing = missing_columns(kind, present, datasets[name].get("columns") or {})
    if missing:
        raise ConfigError(f"{key}: dataset '{name}' has no column '{missing}' "
                          f"({KINDS[kind]['for']} needs {', '.join(KINDS[kind]['needs'])}); its columns are "
                          f"{present} (map names with datasets.{name}.columns)")


def missing_columns(kind: str, present, mapping: dict) -> str | None:
    """The first needed column a dataset lacks (None if none), after the user's column mapping; as
    preprocessing does, the first layout alternative the columns satisfy is the one used."""

    renamed = {c: c for c in present} | {t: s for t, s in mapping.items() if s in present}
    needs = KINDS[kind]["needs"]
    for wanted in LAYOUTS[KINDS[kind]["layout"]]:
        if all(c in renamed for c in wanted):
            # (chosen, rejected) get their prompt from the shared start when preprocessed.
            got = set(wanted) | ({"prompt"} if {"chosen", "rejected"} <= set(wanted) else set())
            return next((c for c in needs if c not in got), None)
    return next(c for c in needs if c not in renamed)


def _first_row_columns(entry: dict, shipped=None) -> list[str] | None:
    """Columns of the first row of a local JSON Lines dataset (after its `format`), read cheaply."""
    files = entry.get("files")
    if files is None:
        return None
    path = Path(paths.from_config(files if isinstance(files, str) else files["train"], shipped))
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return None  # preprocessing names the bad line
                if not isinstance(row, dict):
                    return None
                fmt = entry.get("format")
                return list(FORMAT_COLUMNS[fmt]) if fmt else list(row)
    return None


def eval_targets(ev: dict, runs: dict[str, dict]) -> dict[str, dict]:
    """Eval job name -> what it evaluates. Each listed run is evaluated as its start model + its adapter;
    each base model once alone (`base-<model>`), and that job's completions are the reference of every run
    of that model for win rates: one yardstick, the untrained base, whatever a run started from."""
    targets: dict[str, dict] = {}
    # The reward models judging whose models ship their own code (absent where none do, as `chat` below).
    judges = [n for n in ev["reward_models"] if n in runs and trusted(runs[n].get("model_entry"))]
    for name in ev["runs"]:
        run = runs[name]
        # What reaches the model as chat turns: the datasets' prompts (and lm-eval's, for a chat model). Absent
        # where none do, so the eval jobs of configs without chat models keep their params.
        entry = run.get("model_entry")  # (resolved runs have it)
        chat = [kind for kind in KINDS if entry and ev[kind] and chat_prompts(entry, ev[kind])]
        chat += [judge_chat(d) for d, p in judge_prompt_sets(ev).items() if entry and chat_prompts(entry, p)]
        chat += ["lm_eval"] if entry and ev["lm_eval"]["tasks"] and chat_model(entry) else []
        extra = {**({"chat": chat} if chat else {}), **param(entry), **({TRUSTED_JUDGES: judges} if judges else {})}
        targets[name] = {"kind": "run", "run": name, "model": run["model"], "trainer": run["trainer"],
                         "seed": run["seed"], "reference": BASE_PREFIX + run["model"], **extra}
        targets.setdefault(BASE_PREFIX + run["model"], {
            "kind": "base", "run": None, "model": run["model"], "trainer": "base", "seed": run["seed"],
            "reference": None, **extra})
    return dict(sorted(targets.items()))


def eval_job_inputs(name: str, ev: dict, runs: dict[str, dict], targets: dict | None = None) -> dict:
    """The files one eval job reads (snaketrl.paths), by the names snaketrl.evaluate.job.evaluate's script
    passes on: model (the start model), adapter (runs only), prompts/references/pairs (the prepared split
    of each configured dataset), reward_models (merged reward runs, in evaluation.reward_models order),
    reward_model_prompts (the prepared split of each reward model's own prompts, judge_prompt_sets order),
    reference (the completions of the reference's eval job, for win rates) and reference_pairs (the pair
    log-probabilities of the eval job of the model a run started from: its base, or its policy). `targets`:
    eval_targets(ev, runs), computed once by the caller (per job, it would cost each dry run time quadratic in the
    runs)."""

    targets = targets if targets is not None else eval_targets(ev, runs)
    target = targets[name]
    if target["kind"] == "run":
        run = runs[target["run"]]
        inputs = {"model": paths.merged(run["policy"]) if run.get("policy") else paths.model(run["model"]),
                  "adapter": paths.adapter(target["run"])}
    else:
        inputs = {"model": paths.model(target["model"])}
    for kind in KINDS:
        if ev[kind]:
            inputs[kind] = paths.prepared(ev[kind]["dataset"], ev[kind]["trainer"], ev[kind]["split"])
    if ev["reward_models"]:
        inputs["reward_models"] = [paths.merged(r) for r in ev["reward_models"]]
    sets = judge_prompt_sets(ev)
    if sets:  # in judge_prompt_sets order
        inputs[JUDGE_PROMPTS] = [paths.prepared(d, p["trainer"], p["split"]) for d, p in sets.items()]
    if target["reference"] and (ev["prompts"] or sets):
        inputs["reference"] = paths.evaluation(target["reference"], "completions.jsonl")
    # A run's pair log-probabilities are relative to the model it started from (its adapter disabled): the base,
    # or the policy it started from, whose own eval job scored the pairs with the same weights.
    if ev["pairs"] and target["kind"] == "run":
        start = runs[target["run"]].get("policy") or target["reference"]
        if start in targets:
            inputs["reference_pairs"] = paths.evaluation(start, "pairs.jsonl")
    return inputs
