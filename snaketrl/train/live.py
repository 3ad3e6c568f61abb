"""The live view of the runs: TRL's `report_to: trackio`, on this machine only. trackio keeps a run's curves
in a SQLite store and shows them in a local dashboard (no account, no network). Every run of a workflow
logs into one trackio project, named for the workflow (the working directory, or `training.project`), under
its snaketrl name (seeded and swept names included); the store is the workflow's own (paths.trackio()).
docs/live-view.md says how to open it.

The view is no part of a run's result: `report_to` and `project` stay out of the train jobs' params (turning the
view on or off retrains nothing, and a cut-short run still resumes). The Snakefile hands them to the jobs in
the environment (`environment`: SNAKETRL_LIVE, run name -> fields), where the train job's plan reads its own
(`fields`).

Pure Python: the config check calls check_report_to at parse time. trackio itself is imported only by
transformers' TrackioCallback, in a train job that reports to it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from snaketrl import paths
from snaketrl.errors import ConfigError, TrainingError

# What a run may report to. The others of transformers need an account or the network (wandb, comet_ml, a
# trackio Space), or report to whatever happens to be installed (`all`).
REPORT_TO = ("none", "trackio")
# A Space or server named in the environment would take the curves off this machine; the store is the workflow's.
REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")
# The TRL fields of the live view, and the variable that carries each run's to its train job.
FIELDS = ("report_to", "project")
ENV = "SNAKETRL_LIVE"


def environment(written: dict[str, dict]) -> dict[str, str]:
    """SNAKETRL_LIVE for the jobs: `written` maps each run to its TRL fields as the config merges them; the runs
    that report somewhere, with their live-view fields (none: `{}`, which also overrides one in the caller's shell)."""
    live = {run: {k: args[k] for k in FIELDS if k in args} for run, args in written.items()
            if reporters(args.get("report_to")) not in ([], ["none"])}
    return {ENV: json.dumps(live, sort_keys=True)}


def without_view(args: dict) -> dict:
    """A run's TRL fields as its params hold them: `report_to` as `none` wherever the config writes one (the
    default config always has: its runs keep the params they had before the view), no `project`."""
    return {k: "none" if k == "report_to" else v for k, v in args.items() if k != "project"}


def fields(run: str) -> dict:
    """This run's live-view fields, from the environment the workflow gave its job ({}: none)."""
    return json.loads(os.environ.get(ENV) or "{}").get(run, {})


def reporters(value) -> list[str]:
    """`report_to` as a list: TRL takes one name for a list of one."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_report_to(value, where: str) -> None:
    """`report_to` as written at `where` (config.training.report_to, ...): names of REPORT_TO, `none` alone."""
    names = reporters(value)
    for name in names:
        if name not in REPORT_TO:
            raise ConfigError(f"config: {where}: {name!r} is not something a run reports to here; expected "
                              f"'trackio' (a live view of the runs on this machine: docs/live-view.md) or 'none'")
    if "none" in names and len(names) > 1:
        raise ConfigError(f"config: {where}: 'none' together with {[n for n in names if n != 'none']}; "
                          f"write one of them")


def project(args: dict) -> str:
    """The workflow's trackio project: training.project, else the working directory's name."""
    return args.get("project") or Path.cwd().name


def trackio_args(args: dict, run: str) -> dict:
    """The TRL fields of a run that reports to trackio: its project and name, and no Space. The store is set
    for trackio first (it reads TRACKIO_DIR on import). {} for a run that does not report to trackio."""
    if "trackio" not in reporters(args.get("report_to")):
        return {}
    import importlib.util

    if importlib.util.find_spec("trackio") is None:
        raise ConfigError(f"config: run '{run}': report_to trackio needs the trackio package in the train job's "
                          f"environment: pip install trackio (requirements.txt pins its version)")
    use_store(Path(paths.trackio()).resolve())
    # trackio_static_space_id False: no snapshot Space on the Hub when a model is pushed.
    return {"project": project(args), "run_name": run, "trackio_space_id": None, "trackio_static_space_id": False}


def use_store(store: Path) -> None:
    """Point trackio at `store`, on this machine. trackio reads its directory once, on import: a process that
    imported it for another store cannot log into this one."""
    imported = sys.modules.get("trackio.utils")
    if imported is not None and Path(imported.TRACKIO_DIR).resolve() != store:
        raise TrainingError(f"trackio was imported in this process with its store at {imported.TRACKIO_DIR}, "
                            f"not {store}; train in a fresh process")
    os.environ["TRACKIO_DIR"] = str(store)
    for name in REMOTE:
        os.environ.pop(name, None)


def finish(args) -> None:
    """End the trackio run the final evaluation opened again: transformers' callback finishes it at the end of
    training, and the evaluation after that logs into a new start of it that nothing finishes, whose last records
    a reader may then miss."""
    trackio = sys.modules.get("trackio")
    if trackio is not None and "trackio" in reporters(args.report_to) and trackio.context_vars.current_run.get():
        trackio.finish()
