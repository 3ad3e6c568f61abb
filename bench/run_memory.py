"""Per train run of a finished workflow work dir: its job's seconds, CPU seconds and peak resident memory
(results/benchmarks/train/<run>.tsv), its real tokens/s and the resident memory where training began and at its peak
(results/runs/<run>/metrics.json), and the activation estimate its plan made (the manifest's note, which chose
activation checkpointing: snaketrl/train/memory.py), against what training added above where it began. A markdown
table on stdout; bench/stage_times.py gives the whole run's wall time and each rule's CPU seconds.

    snakemake --cores 2 results/report.html --resources mem_mb=16000 \\
        --configfile config/examples/other-architectures.yaml && python bench/run_memory.py
    python bench/run_memory.py /work/anymodel-fresh
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

ESTIMATE = re.compile(r"activation checkpointing (on|off): activations of (\d+) tokens per forward take about "
                      r"([\d.]+) GiB")
GIB = 2**30


def benchmark(path: Path) -> dict:
    """Snakemake's benchmark record of one job: s, cpu_time, max_rss (MiB: psutil's bytes / 2**20)."""
    with path.open() as f:
        row = next(csv.DictReader(f, delimiter="\t"))
    return {"s": float(row["s"]), "cpu": float(row["cpu_time"]), "max_rss_mib": float(row["max_rss"])}


def run_row(results: Path, run: str) -> dict:
    bench = benchmark(results / "benchmarks" / "train" / f"{run}.tsv")
    metrics = json.loads((results / "runs" / run / "metrics.json").read_text())
    notes = json.loads((results / "runs" / run / "manifest.json").read_text())["plan"]["notes"]
    found = [m for note in notes if (m := ESTIMATE.search(note))]
    checkpointing, tokens, estimate = (found[0][1], int(found[0][2]), float(found[0][3])) if found else (None,) * 3
    begin, peak = metrics.get("train_begin_rss_bytes"), metrics.get("peak_rss_bytes")
    added = (peak - begin) / GIB if begin and peak else None
    # Loading may have peaked higher than any step (a 16-bit copy made from fp32 weights): then the steps added at
    # most this much above where training began, and how much is unknown.
    at_most = bool(begin and peak <= metrics.get("train_begin_peak_rss_bytes", 0))
    return {"run": run, **bench, "real_tokens_per_second": metrics.get("real_tokens_per_second"),
            "begin_gib": begin / GIB if begin else None, "peak_gib": peak / GIB if peak else None,
            "added_gib": added, "at_most": at_most, "estimate_gib": estimate, "tokens": tokens,
            "checkpointing": checkpointing}


def fmt(value, digits=2):
    return "–" if value is None else f"{value:,.{digits}f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", default=".", type=Path)
    args = parser.parse_args(argv)
    results = args.workdir / "results"
    runs = sorted(p.stem for p in (results / "benchmarks" / "train").glob("*.tsv"))
    print("| run | job s | CPU-s | real tokens/s | max_rss GiB | at train start GiB | added GiB | estimate GiB "
          "(tokens a forward, checkpointing) | estimate / added |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        r = run_row(results, run)
        ratio = r["estimate_gib"] / r["added_gib"] if r["estimate_gib"] and r["added_gib"] and r["added_gib"] > 0 \
            else None
        print(f"| {run} | {fmt(r['s'], 0)} | {fmt(r['cpu'], 0)} | {fmt(r['real_tokens_per_second'], 1)} | "
              f"{fmt(r['max_rss_mib'] / 1024)} | {fmt(r['begin_gib'])} | "
              f"{'≤ ' if r['at_most'] else ''}{fmt(r['added_gib'])} | "
              f"{fmt(r['estimate_gib'])} ({r['tokens']}, {r['checkpointing']}) | {fmt(ratio)} |")


if __name__ == "__main__":
    main()
