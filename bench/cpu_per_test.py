"""Where README line 2's CPU goes: each test's CPU time, its own, its children's and its Snakemake commands'
(forked by tests/snakemake_cli.py, whose time reaches no rusage of the worker). A pytest plugin that appends one
tab-separated row per test to $SNAKETRL_CPU_LOG; run as a script, it sums that file per test file.

    rm -f /tmp/cpu.tsv
    SNAKETRL_CPU_LOG=/tmp/cpu.tsv PYTHONPATH=bench python -m pytest -n 2 -p cpu_per_test
    python bench/cpu_per_test.py /tmp/cpu.tsv

A fixture's CPU counts for the first test that uses it (the workflow run: tests/test_browser.py's)."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import defaultdict

import pytest


def _cpu() -> tuple[float, float, float]:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    commands = sys.modules["snakemake_cli"].cpu_seconds[0] if "snakemake_cli" in sys.modules else 0.0
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, commands


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started = _cpu(), time.time()
    yield
    spent = [after - first for after, first in zip(_cpu(), before)]
    with open(os.environ["SNAKETRL_CPU_LOG"], "a") as log:
        log.write("\t".join([item.nodeid, *(f"{s:.2f}" for s in spent), f"{time.time() - started:.2f}"]) + "\n")


def main(path: str) -> None:
    files, total = defaultdict(float), 0.0
    for line in open(path):
        nodeid, *spent, _ = line.rstrip("\n").split("\t")
        files[nodeid.split("::")[0]] += sum(map(float, spent))
        total += sum(map(float, spent))
    for name, cpu in sorted(files.items(), key=lambda item: -item[1]):
        print(f"{cpu:8.1f}  {name}")
    print(f"{total:8.1f}  CPU-seconds in all tests")


if __name__ == "__main__":
    main(sys.argv[1])
