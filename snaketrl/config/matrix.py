"""The run matrix: the runs a config asks for (`matrix` x `runs`, each with what it inherits from its trainer's
entry), and each run once per seed.
"""

from __future__ import annotations

import copy
import re
import string

from snaketrl.errors import ConfigError, closest

# Names that become folders under results/ and wildcard values: one path segment, no '..' ('~' and '+': swept
# values in run names, snaketrl.config.sweeps).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.~+-]*")
NAME_CHARS = "letters, digits, '_', '.', '~', '+', '-', starting with a letter or digit"


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
             "max_tokens", "max_flops")


def written_at(config: dict, name: str, run: dict, key: str) -> str:
    """The key path where a run's `key` is written: its `runs` entry (a swept run's: its un-swept run's), the
    matrix (trainer, model), or its trainer's entry (dataset, reward_funcs, policy, ...)."""
    base = run.get("sweep") or name
    if key in (config.get("runs") or {}).get(base, {}):
        return f"runs.{base}.{key}"
    if key in ("trainer", "model"):
        return f"matrix.{key}s"
    return f"trainers.{run['trainer']}.{key}"


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
