"""The live view of the runs: TRL's `report_to: trackio`, on this machine only. trackio keeps a run's curves
in a SQLite store and shows them in a local dashboard (no account, no network). Every run of a workflow
logs into one trackio project, named for the workflow (the working directory, or `training.project`), under
its snaketrl name (seeded and swept names included); the store is the workflow's own (paths.trackio()).
docs/live-view.md says how to open it.

Pure Python: the config check calls check_report_to at parse time. trackio itself is imported only by
transformers' TrackioCallback, in a train job that reports to it.
"""

from __future__ import annotations

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
