"""What every rule script shares: its log file, and one-line errors on the console."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout

from snaketrl.errors import SnaketrlError, one_line

# An internal error's message can be a page (a tensor repr, a config dump); the log has all of it.
MAX_INTERNAL_MESSAGE = 300


@contextmanager
def logged(snakemake, offline: bool = True):
    """Send the script's output to the rule's log. Any error reaches the console as one line
    `snaketrl: error in rule <rule>: ...` and exits 1: a user error (SnaketrlError) as its message, anything
    else as an internal error whose traceback is in the log. Every job but a download runs offline, on the
    local copies the download rules made (cluster nodes often have no internet)."""
    if offline:
        go_offline()
    log_path = snakemake.log[0]
    with open(log_path, "w", buffering=1) as log, redirect_stdout(log), redirect_stderr(log), _logging_to(log):
        try:
            yield
        except SnaketrlError as err:
            _fail(snakemake.rule, one_line(str(err)), log)
        except Exception as err:  # a bug, not bad input: say so, and where the details are
            traceback.print_exc(file=log)
            message = one_line(f"{type(err).__name__}: {err}", MAX_INTERNAL_MESSAGE)
            _fail(snakemake.rule, f"internal error: {message} (full traceback in {log_path})", log)


def go_offline() -> None:
    """Offline for the Hub from here on, whether or not huggingface_hub and datasets are imported yet: they
    read these variables once, at import (a job of the workflow's fork server finds them imported)."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if hub := sys.modules.get("huggingface_hub.constants"):
        hub.HF_HUB_OFFLINE = True
    if datasets := sys.modules.get("datasets.config"):
        datasets.HF_HUB_OFFLINE = datasets.HF_DATASETS_OFFLINE = True


def _fail(rule: str, message: str, log) -> None:
    line = f"snaketrl: error in rule {rule}: {message}"
    print(line, file=log)
    print(line, file=sys.__stderr__, flush=True)
    raise SystemExit(1) from None


@contextmanager
def _logging_to(log):
    """Root logging into the log for the block; the previous handlers come back after (tests call this twice).
    So do the handlers libraries made at import (transformers', datasets'), which hold the process's stderr of
    that moment: a job of the workflow's fork server (snaketrl.forkserver) imported them before its log opened."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    loggers = [x for x in list(logging.Logger.manager.loggerDict.values()) if isinstance(x, logging.Logger)]
    moved = [h for x in loggers for h in x.handlers
             if isinstance(h, logging.StreamHandler) and h.stream in (sys.__stderr__, sys.__stdout__)]
    streams = [h.setStream(log) for h in moved]
    try:
        yield
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for h, stream in zip(moved, streams):
            h.setStream(stream)
