"""Dry-run time of the workflow vs Snakemake's own start-up and DAG building.

Default mode: the full default matrix (or --configfile) against a one-job trivial Snakefile.
--runs N: the default's trainers over N/5 tiny models (copies of the default's model entries) against a
trivial Snakefile of the same job count (one rule with a wildcard, `all` collecting its outputs): what the
workflow's jobs cost beyond Snakemake's minimum per job. Prints both medians (wall and CPU time, the two
dry runs taking turns), the job counts and the ratios. Parsing never imports torch/transformers/trl.
--floor (with --runs): a third Snakefile, the trivial one whose rule declares what each of ours must
(log, conda env, script, resources growing with the attempt, a params function), still one input and
one output per job: what Snakemake itself costs for those directives, the lowest ratio the workflow
could reach.
Usage: python bench/dryrun.py [--configfile FILE | --runs N [--floor]] [--repeats N]
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
    """The default config with runs/5 tiny models: the default's own, then numbered copies of its entries
    in turn; the matrix trains every trainer on each. The evaluation judges with the reward runs of the
    default's models, as the default does."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    trainers = cfg["matrix"]["trainers"]
    if runs < len(trainers) or runs % len(trainers):
        sys.exit(f"--runs: expected a positive multiple of {len(trainers)} (the default's trainers), got {runs}")
    originals = list(cfg["models"].items())
    models = {}
    for i in range(runs // len(trainers)):
        name, entry = originals[i % len(originals)]
        models[name if i < len(originals) else f"{name}-{i // len(originals)}"] = copy.deepcopy(entry)
    cfg["models"] = models
    cfg["matrix"]["models"] = list(models)
    if cfg.get("evaluation"):
        cfg["evaluation"]["reward_models"] = [
            r for r in cfg["evaluation"].get("reward_models", []) if r.removeprefix("reward-") in models]
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


def main():
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--configfile")
    mode.add_argument("--runs", type=int, help="N runs: the default's trainers over N/5 tiny models")
    ap.add_argument("--floor", action="store_true",
                    help="with --runs: also time the trivial DAG with every rule's directives")
    ap.add_argument("--repeats", type=int, default=5)
    opts = ap.parse_args()
    if opts.floor and not opts.runs:
        ap.error("--floor needs --runs")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = list(DRY_RUN)
        if opts.runs:
            configfile = Path(tmp, "config.yaml")
            configfile.write_text(yaml.safe_dump(scaled_config(opts.runs), sort_keys=False))
            cmd += ["--configfile", str(configfile)]
        elif opts.configfile:
            cmd += ["--configfile", str(Path(opts.configfile).resolve())]
        samples = [dry_run(cmd, ROOT)]
        jobs = samples[0][2] if opts.runs else 1
        trivial_dir = Path(tmp, "trivial")
        trivial_dir.mkdir()
        Path(trivial_dir, "Snakefile").write_text(trivial_snakefile(jobs))
        floor_dir = Path(tmp, "floor")
        if opts.floor:
            write_snakefile(floor_dir, floor_snakefile(jobs))
        # Turns, so that a change in the machine's load touches every side alike.
        trivial_samples, floor_samples = [dry_run(DRY_RUN, trivial_dir)], []
        for i in range(opts.repeats):
            if opts.floor:
                floor_samples.append(dry_run(DRY_RUN, floor_dir))
            if i:
                samples.append(dry_run(cmd, ROOT))
                trivial_samples.append(dry_run(DRY_RUN, trivial_dir))
    (ours, ours_cpu, jobs), (trivial, trivial_cpu, trivial_jobs) = medians(samples), medians(trivial_samples)
    label = f"snaketrl, {opts.runs} runs" if opts.runs else "snaketrl"
    print(f"{'dry-run (median of ' + str(opts.repeats) + ')':<28}{'wall':>8}{'CPU':>8}{'jobs':>7}")
    print(f"{'trivial Snakefile':<28}{trivial:>7.2f}s{trivial_cpu:>7.2f}s{trivial_jobs:>7}")
    if floor_samples:
        floor, floor_cpu, floor_jobs = medians(floor_samples)
        print(f"{'trivial + rule directives':<28}{floor:>7.2f}s{floor_cpu:>7.2f}s{floor_jobs:>7}")
    print(f"{label:<28}{ours:>7.2f}s{ours_cpu:>7.2f}s{jobs:>7}")
    if floor_samples:
        print(f"{'ratio, floor':<28}{floor / trivial:>7.2f}x{floor_cpu / trivial_cpu:>7.2f}x")
    print(f"{'ratio':<28}{ours / trivial:>7.2f}x{ours_cpu / trivial_cpu:>7.2f}x")


if __name__ == "__main__":
    main()
