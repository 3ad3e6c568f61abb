"""Per train run of a finished workflow work dir: its job's seconds, CPU seconds and peak resident memory
(results/benchmarks/train/<run>.tsv), its real tokens/s and the resident memory where training began and at its peak
(results/runs/<run>/metrics.json), and the estimate its plan made where memory chose activation checkpointing
(metrics.json's `activation_estimate_bytes` and `trained_state_estimate_bytes`: snaketrl/train/memory.py), against
what training added above where it began. A markdown
table on stdout; bench/stage_times.py gives the whole run's wall time and each rule's CPU seconds.

    snakemake --cores 2 results/report.html --resources mem_mb=16000 \\
        --configfile config/examples/other-architectures.yaml && python bench/run_memory.py
    python bench/run_memory.py /work/anymodel-fresh
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

GIB = 2**30


def benchmark(path: Path) -> dict:
    """Snakemake's benchmark record of one job: s, cpu_time, max_rss (MiB: psutil's bytes / 2**20)."""
    with path.open() as f:
        row = next(csv.DictReader(f, delimiter="\t"))
    return {"s": float(row["s"]), "cpu": float(row["cpu_time"]), "max_rss_mib": float(row["max_rss"])}


def run_row(results: Path, run: str) -> dict:
    bench = benchmark(results / "benchmarks" / "train" / f"{run}.tsv")
    metrics = json.loads((results / "runs" / run / "metrics.json").read_text())
    # the plan's numbers where memory chose checkpointing (the config set it otherwise)
    planned = "activation_estimate_bytes" in metrics
    estimate = (metrics["activation_estimate_bytes"] + metrics["trained_state_estimate_bytes"]) / GIB \
        if planned else None
    tokens = metrics.get("estimate_tokens_per_forward")
    checkpointing = ("on" if metrics["activation_checkpointing"] else "off") if planned else None
    room = metrics["checkpointing_room_bytes"] / GIB if planned else None
    begin, peak = metrics.get("train_begin_rss_bytes"), metrics.get("peak_rss_bytes")
    added = (peak - begin) / GIB if begin and peak else None
    # Loading may have peaked higher than any step (a 16-bit copy made from fp32 weights): then the steps added at
    # most this much above where training began, and how much is unknown.
    at_most = bool(begin and peak <= metrics.get("train_begin_peak_rss_bytes", 0))
    return {"run": run, **bench, "real_tokens_per_second": metrics.get("real_tokens_per_second"),
            "begin_gib": begin / GIB if begin else None, "peak_gib": peak / GIB if peak else None,
            "added_gib": added, "at_most": at_most, "estimate_gib": estimate, "tokens": tokens,
            "checkpointing": checkpointing, "room_gib": room}


def fmt(value, digits=2):
    return "–" if value is None else f"{value:,.{digits}f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", default=".", type=Path)
    args = parser.parse_args(argv)
    results = args.workdir / "results"
    runs = sorted(p.stem for p in (results / "benchmarks" / "train").glob("*.tsv"))
    print("| run | job s | CPU-s | real tokens/s | max_rss GiB | at train start GiB | added GiB | estimate GiB "
          "(tokens a forward, checkpointing) | room GiB | estimate / added |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        r = run_row(results, run)
        ratio = r["estimate_gib"] / r["added_gib"] if r["estimate_gib"] and r["added_gib"] and r["added_gib"] > 0 \
            else None
        print(f"| {run} | {fmt(r['s'], 0)} | {fmt(r['cpu'], 0)} | {fmt(r['real_tokens_per_second'], 1)} | "
              f"{fmt(r['max_rss_mib'] / 1024)} | {fmt(r['begin_gib'])} | "
              f"{'≤ ' if r['at_most'] else ''}{fmt(r['added_gib'])} | "
              f"{fmt(r['estimate_gib'])} ({r['tokens']}, {r['checkpointing']}) | {fmt(r['room_gib'])} | "
              f"{fmt(ratio)} |")


if __name__ == "__main__":
    main()
