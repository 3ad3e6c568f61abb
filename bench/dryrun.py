"""Dry-run time of the workflow vs Snakemake's own start-up and DAG building.

Default mode: the full default matrix (or --configfile) against a one-job trivial Snakefile.
--runs N: the default's trainers over N/5 tiny models (copies of the default's model entries) against a
trivial Snakefile of the same job count (one rule with a wildcard, `all` collecting its outputs): what the
workflow's jobs cost beyond Snakemake's minimum per job. Prints each dry run's medians (wall and CPU time,
all dry runs taking turns), the job counts and the ratios. Parsing never imports torch/transformers/trl.
--floor (with --runs): a third Snakefile, the trivial one whose rule declares what each of ours must
(log, conda env, script, resources growing with the attempt, a params function), still one input and
one output per job: what Snakemake itself costs for those directives, the lowest ratio the workflow
could reach.
--engine (with --runs): both dry runs again without two of Snakemake's own per-job costs (patched in this
benchmark's process only, never in the workflow): the script check repeated for every job, and the
signature inspection of every function for every job. What a Snakemake fix would give.
Usage: python bench/dryrun.py [--configfile FILE | --runs N [--floor] [--engine]] [--repeats N]
"""

import argparse
import copy
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from snaketrl.config import expand_runs
from snaketrl.evaluate.kinds import reward_model_run

ROOT = Path(__file__).resolve().parents[1]
# --forceall: every job is planned, whatever results/ already holds.
DRY_RUN = [sys.executable, "-m", "snakemake", "-n", "--forceall", "--cores", "1"]


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def dry_run(cmd, cwd):
    """Wall and CPU time of one dry run (CPU time is steadier on a shared machine), and its job count
    (the `total` of Snakemake's job stats)."""
    start, cpu = time.perf_counter(), cpu_seconds()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    total = re.search(r"^total\s+(\d+)\s*$", proc.stdout, re.M)
    if proc.returncode or not total:
        sys.exit(f"{' '.join(map(str, cmd))} failed in {cwd}:\n{proc.stderr[-3000:]}")
    return wall, cpu, int(total.group(1))


def medians(samples):
    """Median wall and CPU time of repeated dry runs, and their job count."""
    walls, cpus, jobs = zip(*samples)
    return statistics.median(walls), statistics.median(cpus), jobs[0]


def scaled_config(runs: int) -> dict:
    """The default config with runs/5 tiny models (with_models); the matrix trains every trainer on each."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    trainers = cfg["matrix"]["trainers"]
    if runs < len(trainers) or runs % len(trainers):
        sys.exit(f"--runs: expected a positive multiple of {len(trainers)} (the default's trainers), got {runs}")
    return with_models(cfg, runs // len(trainers))


def with_models(cfg: dict, n: int) -> dict:
    """A copy of cfg whose matrix trains on n models: the first n of its matrix models, then numbered copies of
    their entries in turn. The evaluation judges with those of its reward runs that the matrix still has."""
    cfg = copy.deepcopy(cfg)
    originals = cfg["matrix"]["models"]
    if n < 1 or not originals:
        sys.exit(f"models: expected a positive count and a matrix with models, got {n} and {originals}")
    models = []
    for i in range(n):
        name = originals[i % len(originals)]
        if i >= len(originals):
            cfg["models"][f"{name}-{i // len(originals)}"] = copy.deepcopy(cfg["models"][name])
            name = f"{name}-{i // len(originals)}"
        models.append(name)
    cfg["matrix"]["models"] = models
    if (cfg.get("evaluation") or {}).get("reward_models"):
        runs = expand_runs(cfg)
        cfg["evaluation"]["reward_models"] = [r for r in cfg["evaluation"].get("reward_models", [])
                                              if reward_model_run(r) in runs]
    return cfg


def trivial_snakefile(jobs: int) -> str:
    """One wildcard rule and `all`: `jobs` jobs, nothing but Snakemake's own work."""
    return (f'rule all:\n    input: expand("out/{{i}}.txt", i=range({jobs - 1}))\n\n'
            'rule one:\n    output: "out/{i}.txt"\n    shell: "touch {output}"\n')


def floor_snakefile(jobs: int) -> str:
    """trivial_snakefile's jobs, each declaring the directives every snaketrl rule has."""
    return (f'rule all:\n    input: expand("out/{{i}}.txt", i=range({jobs - 1}))\n\n'
            'rule one:\n    output: "out/{i}.txt"\n    log: "logs/{i}.log"\n    conda: "env.yaml"\n'
            '    resources: mem_mb=lambda wc, attempt: 8000 * attempt\n'
            '    params: settings=lambda wc: {"i": wc.i}\n    script: "one.py"\n')


def write_snakefile(path: Path, text: str):
    path.mkdir()
    Path(path, "Snakefile").write_text(text)
    Path(path, "one.py").write_text("")
    Path(path, "env.yaml").write_text("dependencies: [python]\n")


# --engine: the dry run with two of Snakemake 9.27's own per-job costs taken away, in this benchmark's
# process only (the workflow runs on Snakemake as released). ScriptProcessor re-reads a rule's script
# for every job to check that it exists; get_function_params inspects the signature of every input,
# params and resource function for every job. A script path without wildcards needs the check once a rule,
# and a function's signature never changes.
SCRIPT_ONCE = """
import snakemake.dag as dag
checked, check = set(), dag.ScriptProcessor.process_job
def once(self, job):
    key = (self.script_type, job.rule.name)
    if key not in checked or "{" in str(getattr(job.rule, self.script_type)):
        checked.add(key)
        check(self, job)
dag.ScriptProcessor.process_job = once
"""
SIGNATURES_CACHED = """
import functools, inspect, snakemake.common as common, snakemake.io as io, snakemake.jobs as jobs
import snakemake.resources as resources, snakemake.rules as rules
signature = functools.lru_cache(maxsize=None)(lambda func: inspect.signature(func).parameters)
def params(func):
    if hasattr(func, common.FUNC_OVERWRITE_PARAMS_ATTR):
        return getattr(func, common.FUNC_OVERWRITE_PARAMS_ATTR)
    return signature(func)
def aux_params(func, candidates):
    names = params(func)
    if any(p.kind == p.VAR_KEYWORD for p in names.values()):
        return candidates
    return {k: v for k, v in candidates.items() if k in names}
for module in (common, rules, jobs):
    module.get_function_params = params
for module in (common, rules, resources, io):
    module.get_input_function_aux_params = aux_params
"""


def patched(cmd, *patches):
    """cmd (a `python -m snakemake` dry run) with patches applied first (after snakemake.cli: importing
    snakemake.dag first is a circular import)."""
    code = "import snakemake.cli\n" + "".join(patches) + "snakemake.cli.main()\n"
    return [sys.executable, "-c", code, *cmd[3:]]


def main():
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--configfile")
    mode.add_argument("--runs", type=int, help="N runs: the default's trainers over N/5 tiny models")
    ap.add_argument("--floor", action="store_true",
                    help="with --runs: also time the trivial DAG with every rule's directives")
    ap.add_argument("--engine", action="store_true",
                    help="with --runs: also time both dry runs without two of Snakemake's per-job costs")
    ap.add_argument("--repeats", type=int, default=5)
    opts = ap.parse_args()
    if (opts.floor or opts.engine) and not opts.runs:
        ap.error("--floor and --engine need --runs")
    label = f"snaketrl, {opts.runs} runs" if opts.runs else "snaketrl"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = list(DRY_RUN)
        if opts.runs:
            configfile = Path(tmp, "config.yaml")
            configfile.write_text(yaml.safe_dump(scaled_config(opts.runs), sort_keys=False))
            cmd += ["--configfile", str(configfile)]
        elif opts.configfile:
            cmd += ["--configfile", str(Path(opts.configfile).resolve())]
        jobs = dry_run(cmd, ROOT)[2] if opts.runs else 1
        trivial_dir, floor_dir = Path(tmp, "trivial"), Path(tmp, "floor")
        trivial_dir.mkdir()
        Path(trivial_dir, "Snakefile").write_text(trivial_snakefile(jobs))
        sides = {"trivial Snakefile": (DRY_RUN, trivial_dir)}
        if opts.floor:
            write_snakefile(floor_dir, floor_snakefile(jobs))
            sides["trivial + rule directives"] = (DRY_RUN, floor_dir)
        sides[label] = (cmd, ROOT)
        if opts.engine:
            sides["trivial, signatures cached"] = (patched(DRY_RUN, SIGNATURES_CACHED), trivial_dir)
            sides[f"{label}, scripts once"] = (patched(cmd, SCRIPT_ONCE), ROOT)
            sides[f"{label}, both"] = (patched(cmd, SCRIPT_ONCE, SIGNATURES_CACHED), ROOT)
        # Turns, so that a change in the machine's load touches every side alike.
        samples = {name: [] for name in sides}
        for _ in range(opts.repeats):
            for name, (side_cmd, cwd) in sides.items():
                samples[name].append(dry_run(side_cmd, cwd))
    times = {name: medians(s) for name, s in samples.items()}
    print(f"{'dry-run (median of ' + str(opts.repeats) + ')':<40}{'wall':>8}{'CPU':>8}{'jobs':>7}")
    for name, (wall, cpu, n) in times.items():
        print(f"{name:<40}{wall:>7.2f}s{cpu:>7.2f}s{n:>7}")
    ratios = {"ratio": (label, "trivial Snakefile")}
    if opts.floor:
        ratios["ratio, floor"] = ("trivial + rule directives", "trivial Snakefile")
    if opts.engine:
        ratios["ratio, scripts once"] = (f"{label}, scripts once", "trivial Snakefile")
        ratios["ratio, both (trivial as released)"] = (f"{label}, both", "trivial Snakefile")
        ratios["ratio, both (trivial cached too)"] = (f"{label}, both", "trivial, signatures cached")
    for name, (a, b) in ratios.items():
        print(f"{name:<40}{times[a][0] / times[b][0]:>7.2f}x{times[a][1] / times[b][1]:>7.2f}x")


if __name__ == "__main__":
    main()
