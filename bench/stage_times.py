"""The time of each stage of a finished workflow run, read from its Snakemake log: every job's start and end, summed
per rule (jobs of a rule may overlap), the run's wall time, and the CPU seconds the benchmarked rules (train,
evaluate, pretrain) recorded in results/benchmarks/.

    snakemake --cores 2 --configfile config/smollm2.yaml && python bench/stage_times.py
    python bench/stage_times.py .snakemake/log/2026-11-25T105753.472057.snakemake.log --jobs
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
START = re.compile(r"^(?:local)?rule (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def jobs(log: Path) -> list[dict]:
    """[{rule, wildcards, start, end}] of every job the log saw finish."""
    started, out, stamp, current = {}, [], None, None
    for line in log.read_text().splitlines():
        if m := STAMP.match(line):
            stamp, current = datetime.strptime(m[1], "%a %b %d %H:%M:%S %Y"), None
        elif m := START.match(line):
            current = {"rule": m[1], "start": stamp, "wildcards": ""}
        elif current and (m := WILDCARDS.match(line)):
            current["wildcards"] = m[1]
        elif current and (m := JOBID.match(line)):
            started[m[1]] = current
        elif m := FINISHED.match(line):
            if m[1] in started:
                out.append({**started.pop(m[1]), "end": stamp})
    return out


def benchmarks(results: Path) -> dict[tuple[str, str], float]:
    """(rule, name) -> cpu_time in seconds, from Snakemake's benchmark files."""
    out = {}
    for path in sorted(results.glob("benchmarks/*/**/*.tsv")):
        rows = list(csv.DictReader(path.open(), delimiter="\t"))
        if rows and rows[-1].get("cpu_time") not in (None, "", "NA"):
            rule = path.relative_to(results / "benchmarks").parts[0]
            out[(rule, path.stem)] = float(rows[-1]["cpu_time"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?", type=Path, help="a Snakemake log (default: the newest in .snakemake/log)")
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--jobs", action="store_true", help="also list every job")
    opts = ap.parse_args()
    log = opts.log or max(Path(".snakemake/log").glob("*.snakemake.log"), default=None)
    if log is None:
        sys.exit("no Snakemake log found in .snakemake/log")
    done = jobs(log)
    if not done:
        sys.exit(f"{log}: no finished jobs")
    cpu = benchmarks(opts.results)
    print(f"{log}: {len(done)} jobs, wall {(max(j['end'] for j in done) - min(j['start'] for j in done)).total_seconds():.0f} s")
    print("| rule | jobs | job time (s), summed | longest job (s) | CPU (s), benchmarked |")
    print("|---|---|---|---|---|")
    for rule in dict.fromkeys(j["rule"] for j in sorted(done, key=lambda j: j["start"])):
        mine = [j for j in done if j["rule"] == rule]
        seconds = [(j["end"] - j["start"]).total_seconds() for j in mine]
        cpus = [v for (r, _), v in cpu.items() if r == rule]
        print(f"| {rule} | {len(mine)} | {sum(seconds):.0f} | {max(seconds):.0f} | "
              f"{f'{sum(cpus):.0f}' if cpus else ''} |")
    if opts.jobs:
        for j in sorted(done, key=lambda j: j["start"]):
            print(f"{j['start']:%H:%M:%S} {(j['end'] - j['start']).total_seconds():6.0f} s  {j['rule']}  {j['wildcards']}")


if __name__ == "__main__":
    main()
