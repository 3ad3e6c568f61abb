"""lm-evaluation-harness: the task names (found by a text scan at parse time, without importing lm_eval)
and the run of its tasks on a loaded model in the eval job.
"""

from __future__ import annotations

import re
from pathlib import Path

from snaketrl.errors import ConfigError, close_match
from snaketrl.evaluate.loading import max_positions

# lm-evaluation-harness tasks defined in this project (TaskManager include_path).
LM_EVAL_TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


LM_EVAL_PIN = "lm-eval==0.4.13"


_TASK_LINE = re.compile(r"^(?:task|group|tag):[ \t]*['\"]?([^\s'\"#\[]+)", re.M)


_TAG_LIST = re.compile(r"^tag:[ \t]*\n((?:[ \t]+-[ \t]*\S+[ \t]*\n)+)", re.M)


def _task_names(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    names = set(_TASK_LINE.findall(text))
    for block in _TAG_LIST.findall(text):
        names.update(re.findall(r"-[ \t]*['\"]?([^\s'\"]+)", block))
    return names


def project_tasks() -> set[str]:
    return set().union(*(_task_names(p) for p in sorted(LM_EVAL_TASKS_DIR.glob("*.yaml")))) if (
        LM_EVAL_TASKS_DIR.is_dir()) else set()


def _project_task_config(task: str) -> dict | None:
    """The YAML of a project task (plain YAML: no `!function`, no `include`), None for lm-eval's own tasks."""
    import yaml

    for path in sorted(LM_EVAL_TASKS_DIR.glob("*.yaml")):
        if task in _task_names(path):
            cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
            return cfg if isinstance(cfg, dict) and cfg.get("task") == task else None
    return None


def _data_files(cfg: dict) -> list[str]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(files, dict):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    return [files] if isinstance(files, str) else list(files)


def project_task_files(tasks) -> list[str]:
    """The local data files the named project tasks read, as their YAML writes them: relative to the workflow's
    root, where they ship (data/samples/arithmetic.jsonl). In order, once each. The eval job takes the
    workflow's copies as its `lm_eval_data` input (lm_eval_run maps these names to them), so it reads the
    same files from any working directory, and an edit of one reruns the evaluation."""
    out = []
    for task in tasks or []:
        cfg = _project_task_config(task)
        for f in _data_files(cfg) if cfg else []:
            if "://" not in f and not Path(f).is_absolute() and f not in out:
                out.append(f)
    return out


def task_specs(tasks, data_files: dict[str, str] | None) -> list:
    """What lm-eval loads per task: its name, or for a project task reading local files, its config with each
    file swapped for where `data_files` says it is (project_task_files' names -> the eval job's inputs)."""
    specs = []
    for task in tasks:
        cfg = _project_task_config(task) if data_files else None
        if cfg and _data_files(cfg):
            kwargs = cfg["dataset_kwargs"]
            files = _map_files(kwargs["data_files"], lambda f: data_files.get(f, f))
            specs.append({**cfg, "dataset_kwargs": {**kwargs, "data_files": files}})
        else:
            specs.append(task)
    return specs


def _map_files(files, swap):
    """`data_files` (a path, a list of them, or split -> either) with `swap` applied to every path."""
    if isinstance(files, dict):
        return {split: _map_files(v, swap) for split, v in files.items()}
    return swap(files) if isinstance(files, str) else [swap(f) for f in files]


def lm_eval_installed() -> Path | None:
    """lm_eval's task directory, found without importing it (its import loads torch)."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    return Path(spec.origin).parent / "tasks" if spec and spec.origin else None


def builtin_tasks() -> set[str]:
    """Task, group and tag names of lm-eval's own task YAMLs (a text scan, ~0.5 s; lm-eval's TaskManager,
    which the eval job uses, is authoritative)."""
    root = lm_eval_installed()
    return set().union(*(_task_names(p) for p in root.rglob("*.yaml"))) if root else set()


def check_lm_eval_tasks(tasks, where: str) -> None:
    if not tasks:
        return
    own = project_tasks()
    others = [t for t in tasks if t not in own]
    if not others:
        return
    if lm_eval_installed() is None:
        raise ConfigError(f"{where}: lm-eval task '{others[0]}' needs lm-eval, which is not installed "
                          f"(pip install {LM_EVAL_PIN}); project tasks are {sorted(own)}")
    known = builtin_tasks()
    for task in others:
        if task not in known:
            raise ConfigError(f"{where}: unknown lm-eval task '{task}'{close_match(task, own | known)}; project tasks "
                              f"(snaketrl/evaluate/lm_eval_tasks) are {sorted(own)}")


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ConfigError(f"evaluation.lm_eval: lm-eval is not installed ({err}); pip install {LM_EVAL_PIN}") from None
    return lm_eval, HFLM, TaskManager


def _lm_eval_available() -> bool:
    from snaketrl.evaluate.harness import lm_eval_installed

    return lm_eval_installed() is not None


def lm_eval_task_manager(tasks, include_path=LM_EVAL_TASKS_DIR):
    """lm-eval's TaskManager with the project's tasks (and lm-eval's own only when a task needs them:
    indexing those takes seconds). An unknown task is a one-line ConfigError, found by a text scan of the
    task YAMLs before lm-eval indexes anything; cheap enough to call before the model loads."""
    from snaketrl.evaluate.harness import check_lm_eval_tasks, project_tasks

    _, _, TaskManager = _import_lm_eval()
    check_lm_eval_tasks(tasks, "evaluation.lm_eval.tasks")
    own = project_tasks() if Path(include_path) == LM_EVAL_TASKS_DIR else set()
    manager = TaskManager(include_path=str(include_path), include_defaults=any(t not in own for t in tasks))
    missing = [t for t in tasks if t not in set(manager.all_tasks)]
    if missing:  # the scan took it for a task, lm-eval does not
        raise ConfigError(f"evaluation.lm_eval.tasks: lm-eval has no task '{missing[0]}'")
    return manager


def lm_eval_run(model, tokenizer, tasks, *, limit=None, batch_size: int = 8, num_fewshot=None, seed: int = 0,
                task_manager=None, max_length: int | None = None, data_files: dict[str, str] | None = None,
                chat: bool = False) -> dict:
    """lm-eval's tasks on a loaded model (a peft model is passed with its adapter active); `chat`: a chat
    model, whose requests lm-eval renders in its chat template.
    Returns {task: {metric,filter: value}} (stderr entries dropped). Project tasks read their data files from
    `data_files` (a file as the task's YAML names it -> where it is: see project_task_files); without it,
    relative to the working directory (the clone's root, as in the tests).

    What `lm_eval.simple_evaluate` does for an LM object (seeds, few-shot settings, then `lm_eval.evaluate`),
    without its environment report: that runs `pip list`, `git` and nine more commands (torch's collect_env),
    1.7 s of every eval job for facts the run's manifest already records."""
    import random

    import numpy as np
    import torch

    lm_eval, HFLM, _ = _import_lm_eval()
    task_manager = task_manager or lm_eval_task_manager(tasks)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA layers stay active
    lm = HFLM(pretrained=inner, tokenizer=tokenizer, batch_size=batch_size,
              max_length=max_length or max_positions(inner))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    loaded = task_manager.load(task_specs(tasks, data_files))
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    results = lm_eval.evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=False, bootstrap_iters=0,
                               apply_chat_template=chat, fewshot_as_multiturn=True)
    out = {}
    for task, values in results["results"].items():
        out[task] = {k: v for k, v in values.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in k}
    return out
