"""What every rule script shares: its log file, and one-line errors for bad input."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout

from snaketrl.errors import SnaketrlError


@contextmanager
def logged(snakemake, offline: bool = True):
    """Send the script's output to the rule's log; a config/data error becomes one clear line
    (also on the console), not a traceback. Every job but a download runs offline, on the
    local copies the download rules made (cluster nodes often have no internet)."""
    if offline:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(snakemake.log[0], "w", buffering=1) as log, redirect_stdout(log), redirect_stderr(log):
        logging.basicConfig(stream=log, level=logging.INFO, force=True,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            yield
        except SnaketrlError as err:
            line = f"snaketrl: error in rule {snakemake.rule}: {err}"
            print(line, file=log)
            print(line, file=sys.__stderr__)
            raise SystemExit(1) from None
        except BaseException:
            traceback.print_exc(file=log)  # the log is where users look first
            raise
