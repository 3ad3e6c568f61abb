"""Hyperparameter sweeps: `sweeps.<trainer>.<TRL field>: [values]` turns each run of that trainer into one
run per combination (snaketrl.report.sweeps reads them back).

Pure Python (pandas and Snakemake's Paramspace, no torch/transformers/trl): the Snakefile runs it at
parse time through snaketrl.config.resolve_runs.
"""

from __future__ import annotations

import itertools
import re

from snaketrl.config.args import check_field
from snaketrl.errors import ConfigError
from snaketrl.evaluate.kinds import reward_model_run
from snaketrl.train.args import OWNED
from snaketrl.trainers import REGISTRY

# A swept value becomes part of the run name, so of paths and wildcards.
VALUE = re.compile(r"[A-Za-z0-9_.+-]+")


def check_sweeps(config: dict, runs: dict[str, dict]) -> dict[str, dict[str, list]]:
    """Every swept trainer has runs, every swept key is a field of its TRL config that the config may set,
    every value is one the field takes and can be part of a run name, and no run sets a swept key itself.
    Returns each grid with its values as the jobs take them (snaketrl.config.args.value)."""
    out = {}
    for trainer, grid in (config.get("sweeps") or {}).items():
        where = f"config: sweeps.{trainer}"
        if trainer not in REGISTRY:
            raise ConfigError(f"{where}: unknown trainer; expected one of {sorted(REGISTRY)}")
        if not any(run["trainer"] == trainer for run in runs.values()):
            raise ConfigError(f"{where}: no run trains '{trainer}' (add it to matrix.trainers or runs)")
        out[trainer] = {}
        for key, values in grid.items():
            if key in OWNED:
                raise ConfigError(f"{where}.{key}: set by {OWNED[key]}, it cannot be swept")
            out[trainer][key] = [check_field(REGISTRY[trainer].config, key, v, f"sweeps.{trainer}.{key}")
                                 for v in values]
            for value in values:
                if not VALUE.fullmatch(str(value)):
                    raise ConfigError(f"{where}.{key}: value {value!r} cannot be part of a run name (letters, "
                                      f"digits, '_', '.', '+', '-' only)")
        for name, run in runs.items():
            clash = sorted(set(grid) & set(run.get("args", {})))
            if run["trainer"] == trainer and clash:
                raise ConfigError(f"config: runs.{name}.args.{clash[0]}: also swept by sweeps.{trainer}.{clash[0]}; "
                                  f"set it in one place")
    return out


def with_sweeps(config: dict, runs: dict[str, dict]) -> dict[str, dict]:
    """Each run of a swept trainer once per combination of the swept values, as `<run>-<key>~<value>_...`
    (keys sorted, so names do not depend on the config's key order), with `sweep` (the run's name) and
    `swept` (its values, which override the trainer's args and `training`). A run that another run uses as
    `policy` or `reward_model`, or that `evaluation.reward_models` names, stays as well, un-swept: those
    references keep meaning it."""
    sweeps = {t: grid for t, grid in (config.get("sweeps") or {}).items() if grid}
    if not sweeps:
        return runs
    taken = check_sweeps(config, runs)
    import pandas as pd
    from snakemake.utils import Paramspace

    used = {run[key] for run in runs.values() for key in ("policy", "reward_model") if run.get(key)}
    used |= {reward_model_run(e) for e in (config.get("evaluation") or {}).get("reward_models") or []}
    out = {}
    for name, run in runs.items():
        grid = sweeps.get(run["trainer"])
        if not grid or name in used:
            out[name] = run
        if not grid:
            continue
        keys = sorted(grid)
        combos = list(itertools.product(*(grid[k] for k in keys)))
        values = itertools.product(*(taken[run["trainer"]][k] for k in keys))
        # object dtype: each value keeps its YAML type and spelling in the name (1 stays 1, not 1.0 beside a
        # float; '1e-4' stays 1e-4, while the job gets the number).
        space = Paramspace(pd.DataFrame(combos, columns=keys, dtype=object), filename_params="*")
        for combo, instance in zip(values, space.instance_patterns):
            swept, swept_name = dict(zip(keys, combo)), f"{name}-{instance}"
            if swept_name in out or swept_name in runs:
                raise ConfigError(f"config: sweeps.{run['trainer']}: two runs would both be named '{swept_name}' "
                                  f"(values that read the same, such as 0.1 and '0.1', or a run of that name)")
            out[swept_name] = {**run, "args": {**run.get("args", {}), **swept}, "sweep": name, "swept": swept}
    return out
