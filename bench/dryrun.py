"""Dry-run time of the full default matrix vs a trivial Snakefile (Snakemake's own start-up).

Prints both medians and their ratio; parsing must stay close to 1x (no torch/transformers/trl at
parse time). Usage: python bench/dryrun.py [--configfile FILE] [--repeats N]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd, cwd, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configfile")
    ap.add_argument("--repeats", type=int, default=5)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "Snakefile").write_text('rule all:\n    output: "x.txt"\n    shell: "touch {output}"\n')
        trivial = timed([sys.executable, "-m", "snakemake", "-n", "--cores", "1"], tmp, opts.repeats)
    # --forceall: every job of the matrix is planned, whatever results/ already holds.
    cmd = [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--forceall"]
    if opts.configfile:
        cmd += ["--configfile", str(Path(opts.configfile).resolve())]
    ours = timed(cmd, ROOT, opts.repeats)
    print(f"trivial Snakefile dry-run: {trivial:.2f} s")
    print(f"snaketrl dry-run:          {ours:.2f} s")
    print(f"ratio:                     {ours / trivial:.2f}x")


if __name__ == "__main__":
    main()
