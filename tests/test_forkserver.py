"""The workflow's fork server (snaketrl/forkserver.py), with a job script of its own: the first job starts it and
runs itself; later jobs run in a child of it that is the job as far as the job and Snakemake can tell (streams,
working directory, environment, argv, exit status, signals, death with the job's process). The workflow run
(tests/test_workflow.py) is served too; docs/development.md compares its numbers with an unserved run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snaketrl import forkserver

ROOT = Path(__file__).resolve().parents[1]

JOB = """
import json, os, sys, time
warm = "torch" in sys.modules  # true only in a child of the server, which imported it before this ran
from snaketrl.imports import start_job
start_job()
print(json.dumps({"pid": os.getpid(), "warm": warm, "cwd": os.getcwd(), "argv": sys.argv,
                  "tmpdir": os.environ.get("TMPDIR"), "extra": os.environ.get("EXTRA")}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("boom")
if mode == "sleep":
    with open(sys.argv[2], "w") as out:
        out.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A job script and an offer whose owner is this process (an ancestor of every job it starts); the server
    is made to end with the module by removing its socket."""
    tmp = tmp_path_factory.mktemp("forkserver")
    script = tmp / "job.py"
    script.write_text(JOB)
    where = tmp / "server"
    env = {**os.environ, forkserver.ENV: f"{os.getpid()}:{where}", "PYTHONPATH": str(ROOT)}
    env.pop("EXTRA", None)
    yield script, where, env
    for name in ("socket", "lock"):
        (where / name).unlink(missing_ok=True)


def job(served, *args, env=None, cwd=None, **popen):
    script, _, base = served
    return subprocess.Popen([sys.executable, str(script), *args], env={**base, **(env or {})}, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=120)
    return json.loads(out.splitlines()[0]), err


def wait_for(condition, seconds=60.0):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def started(served):
    """The first job: it runs in its own process and leaves the server behind, ready."""
    proc = job(served, "exit", "0")
    first, _ = finish(proc)
    assert proc.returncode == 0 and first["pid"] == proc.pid and not first["warm"]
    wait_for(lambda: (served[1] / "socket").exists())
    return served


def test_a_later_job_runs_in_a_child_of_the_server_as_the_job_itself(started, tmp_path):
    proc = job(started, "exit", "3", env={"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    report, err = finish(proc)
    assert proc.returncode == 3
    assert report["warm"] and report["pid"] != proc.pid
    assert report["cwd"] == str(tmp_path) and report["tmpdir"] == str(tmp_path)
    assert report["argv"] == [str(started[0]), "exit", "3"]
    assert err == "to stderr\n"


def test_an_exception_in_a_served_job_prints_its_traceback_and_exits_1(started):
    proc = job(started, "raise")
    report, err = finish(proc)
    assert report["warm"] and proc.returncode == 1
    assert err.startswith("to stderr\nTraceback") and err.endswith("ValueError: boom\n")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_to_the_jobs_process_reaches_the_job(started, tmp_path, signum):
    """SIGKILL (a cluster's time limit, Snakemake's kill) cannot be passed on: the job dies with its process.
    SIGTERM is passed on, and the job's process then ends by it as the job did."""
    pid_file = tmp_path / "pid"
    proc = job(started, "sleep", str(pid_file))
    wait_for(lambda: pid_file.exists() and pid_file.read_text())
    child = int(pid_file.read_text())
    assert child != proc.pid
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == -signum
    wait_for(lambda: gone(child), 30)


def test_a_job_in_another_environment_runs_in_its_own_process(started):
    proc = job(started, "exit", "0", env={"EXTRA": "1"})
    report, err = finish(proc)
    assert proc.returncode == 0 and report["pid"] == proc.pid and not report["warm"] and report["extra"] == "1"
    assert err.startswith("snaketrl: the fork server did not take this job (other environment variables: EXTRA); "
                          "it runs in this process\n")


def test_without_an_offer_or_from_another_process_tree_a_job_is_not_served(started):
    _, where, _ = started
    proc = job(started, "exit", "0", env={forkserver.ENV: ""})
    assert not finish(proc)[0]["warm"]
    # The offer names a process that is not this job's ancestor: a job on another machine, or under SLURM.
    proc = job(started, "exit", "0", env={forkserver.ENV: f"1:{where}"})
    assert not finish(proc)[0]["warm"]
    proc = job(started, "exit", "0", env={"SLURM_JOB_ID": "7"})
    assert not finish(proc)[0]["warm"]


def test_the_snakefile_offers_only_where_asked_and_never_under_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(forkserver.ENV, raising=False)
    forkserver.offer(True)
    owner, where = os.environ[forkserver.ENV].split(":", 1)
    assert int(owner) == os.getpid() and Path(where).name.startswith(f"snaketrl-forkserver-{os.getpid()}-")
    forkserver.offer(False)
    assert forkserver.ENV not in os.environ
    monkeypatch.setenv(forkserver.ENV, "0")  # the user's switch: off
    forkserver.offer(True)
    assert os.environ[forkserver.ENV] == "0"
    monkeypatch.setenv(forkserver.ENV, "123:/elsewhere")  # inherited by a SLURM job's own Snakemake
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    forkserver.offer(True)
    assert forkserver.ENV not in os.environ
