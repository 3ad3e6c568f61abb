"""How far above its noise each learning check of the tests sits: the default's runs over seeds and CPU kernel paths.

Each (kernel path, seed) trains the default's runs in a fresh copy of the workflow with `seed: N` (so the tiny
bases, the splits and the training all change with it), then measures what tests/learning.py measures: SFT's
eval-loss drop, DPO's and the reward model's held-out accuracy above chance, the rise of GRPO's and PPO's reward
from the first third of the logged steps to the last. `--unit` also runs the unit tests that assert learning, under
each path and seed (SNAKETRL_TEST_SEED), and collects what they measured. The table gives every value, then per
check the worst and the median, the test's threshold, and worst / threshold (the issue's target: at least 2).

Kernel paths (what decides a CPU's rounding, besides the thread count): `native` (whatever this CPU picks),
`avx2` (ATEN_CPU_CAPABILITY=avx2) and `default` (ATEN_CPU_CAPABILITY=default: no vector kernels), the last two
with oneDNN capped at AVX2 (DNNL_MAX_CPU_ISA=AVX2), which is what another x86 CPU would run.

    python bench/learning.py                                  # seeds 1 2 3 42 x 3 paths: about 30 min on 2 cores
    python bench/learning.py --seeds 1 --paths native --trainers grpo
    python bench/learning.py --keep /tmp/learning      # keep the runs: after an edit, only what it touches reruns
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from learning import UNIT, WORKFLOW  # noqa: E402  (tests/learning.py: the tests' own measures)

from snaketrl import paths  # noqa: E402

KERNEL_PATHS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "AVX2"},
}
PROJECT = ["Snakefile", "rules", "scripts", "config", "envs", "data", "report"]
UNIT_FILES = ["tests/test_train.py", "tests/test_trainers.py", "tests/test_pretrain.py"]


def environment(path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")}
    return {**env, **KERNEL_PATHS[path], "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}


def workflow(workdir: Path, config: dict, seed: int, trainers: list[str], path: str) -> dict[str, tuple]:
    """Train the config's runs of `trainers` with `seed` under kernel `path`; check name -> (margin, threshold)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in PROJECT:  # a kept directory's results stay: Snakemake reruns what the code or config changed
        if (workdir / name).is_dir():
            shutil.rmtree(workdir / name)
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, workdir / name)
    config = {**config, "seed": seed}
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    models = config["matrix"]["models"]
    runs = [f"{t}-{m}" for t in trainers for m in models if t in config["matrix"]["trainers"]]
    targets = [paths.run_file(r, name) for r in runs for name in ("trainer_state.json", "metrics.json")]
    # --rerun-incomplete: a kept directory's run may have been cut short
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--rerun-incomplete", *targets],
                          cwd=workdir, env=environment(path), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{path} seed {seed}: the workflow failed:\n{proc.stderr[-3000:]}")
    files = {run: (paths.run_file(run, "trainer_state.json"), paths.run_file(run, "metrics.json")) for run in runs}
    files.update({f"pretrain-{m}": (paths.pretrain_file(m, "trainer_state.json"), paths.pretrain_file(m, "metrics.json"))
                  for m in models if "tiny" in config["models"][m]})
    out = {}
    for name, (state, metrics) in files.items():
        state, metrics = (json.loads((workdir / f).read_text()) for f in (state, metrics))
        for check in WORKFLOW[name.split("-", 1)[0]]:
            out[f"{name}: {check.key}"] = (check.measure(state, metrics), check.threshold)
    return out


def unit(seed: int, path: str) -> dict[str, tuple]:
    """The unit tests that assert learning, run with SNAKETRL_TEST_SEED; check name -> (margin, threshold)."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as record:
        env = {**environment(path), "SNAKETRL_TEST_SEED": str(seed), "SNAKETRL_LEARNING_RECORD": record.name}
        tests = [f"{file}::{name}" for name in UNIT for file in UNIT_FILES if name in (ROOT / file).read_text()]
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                       env=env, capture_output=True, text=True)
        rows = [json.loads(line) for line in Path(record.name).read_text().splitlines()]
    return {r["name"]: (r["value"], r["threshold"]) for r in rows}


def summary(values: dict[tuple, dict[str, tuple]]) -> str:
    """A markdown table: one row per check, one column per (path, seed), then worst, median, the test's threshold
    and worst / threshold."""
    cols = sorted(values)
    names = sorted({n for v in values.values() for n in v})
    head = ["check", *(f"{p} s{s}" for p, s in cols), "worst", "median", "threshold", "worst / threshold"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        got = [values[c].get(name) for c in cols]
        seen = [g[0] for g in got if g is not None]
        threshold = next(g[1] for g in got if g is not None)
        worst = min(seen)
        ratio = f"{worst / threshold:.1f}" if threshold > 0 else "-"
        lines.append("| " + " | ".join([name, *("" if g is None else f"{g[0]:+.3f}" for g in got), f"{worst:+.3f}",
                                        f"{statistics.median(seen):+.3f}", f"{threshold}", ratio]) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 42])
    ap.add_argument("--paths", nargs="+", choices=sorted(KERNEL_PATHS), default=list(KERNEL_PATHS))
    trainers = [t for t in WORKFLOW if t != "pretrain"]
    ap.add_argument("--trainers", nargs="+", choices=trainers, default=trainers)
    ap.add_argument("--configfile", type=Path, default=ROOT / "config" / "config.yaml")
    ap.add_argument("--unit", action="store_true", help="also the unit tests that assert learning")
    ap.add_argument("--no-workflow", action="store_true", help="only the unit tests")
    ap.add_argument("--keep", type=Path, help="train in DIR/<path>-seed<N> and keep it (default: a temporary dir); "
                                              "a later call with the same DIR reruns only what changed")
    ap.add_argument("--json", type=Path, help="also write every value here")
    opts = ap.parse_args()
    config = yaml.safe_load(opts.configfile.read_text())
    base = opts.keep or Path(tempfile.mkdtemp(prefix="snaketrl-learning-"))
    values = {}
    for path in opts.paths:
        for seed in opts.seeds:
            started = time.perf_counter()
            got = {}
            if not opts.no_workflow:
                got.update(workflow(base / f"{path}-seed{seed}", config, seed, opts.trainers, path))
            if opts.unit:
                got.update(unit(seed, path))
            values[(path, seed)] = got
            print(f"{path} seed {seed}: {time.perf_counter() - started:.0f} s "
                  + " ".join(f"{k}={v[0]:+.3f}" for k, v in sorted(got.items())), flush=True)
    print()
    print(summary(values))
    if opts.json:
        opts.json.write_text(json.dumps({f"{p} {s}": {k: v[0] for k, v in got.items()}
                                         for (p, s), got in values.items()}, indent=2))
    if not opts.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
