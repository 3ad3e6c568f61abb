"""The workflow's fork server (snaketrl/forkserver.py), with a job script of its own: the first job starts it and
runs itself; later jobs run in a child of it that is the job as far as the job and Snakemake can tell (streams,
working directory, environment, argv, exit status, signals, death with the job's process). The workflow run
(tests/test_workflow.py) is served too; docs/development.md compares its numbers with an unserved run."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from snaketrl import forkserver
from snaketrl.processes import alive, process_stat

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
    offered = forkserver.new_offer(str(tmp))
    where = Path(offered.split(":", 2)[2])
    env = {**os.environ, forkserver.ENV: offered, "PYTHONPATH": str(ROOT)}
    env.pop("EXTRA", None)
    yield script, where, env
    (where / "socket").unlink(missing_ok=True)


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
    with subprocess.Popen(["sleep", "60"]) as other:
        proc = job(started, "exit", "0", env={forkserver.ENV: f"{other.pid}:{process_stat(other.pid)[2]}:{where}"})
        assert not finish(proc)[0]["warm"]
        other.kill()
    proc = job(started, "exit", "0", env={"SLURM_JOB_ID": "7"})
    assert not finish(proc)[0]["warm"]


def test_the_snakefile_offers_only_where_asked_and_never_under_slurm(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(forkserver.ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    forkserver.offer(True)
    owner, started, where = os.environ[forkserver.ENV].split(":", 2)
    assert int(owner) == os.getpid() and started == process_stat(os.getpid())[2]
    assert Path(where).parent == tmp_path and Path(where).name.startswith(f"snaketrl-forkserver-{os.getpid()}-")
    made = os.lstat(where)  # made by the offer: this user's, 0700, a directory
    assert stat.S_ISDIR(made.st_mode) and stat.S_IMODE(made.st_mode) == 0o700 and made.st_uid == os.getuid()
    forkserver.offer(False)
    assert forkserver.ENV not in os.environ
    monkeypatch.setenv(forkserver.ENV, "0")  # the user's switch: off
    forkserver.offer(True)
    assert os.environ[forkserver.ENV] == "0"
    monkeypatch.setenv(forkserver.ENV, "123:/elsewhere")  # inherited by a SLURM job's own Snakemake
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    forkserver.offer(True)
    assert forkserver.ENV not in os.environ


def test_an_offer_never_takes_what_was_at_its_path(monkeypatch, tmp_path, capfd):
    """A directory made before the offer, or a link to one (a world-writable directory of another user's): the
    offer is withdrawn, and nothing is made in what was there."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(forkserver.ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(secrets, "token_hex", lambda n: "f" * 2 * n)
    where = tmp_path / f"snaketrl-forkserver-{os.getpid()}-{'f' * 8}"
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    for premade in (lambda: where.mkdir(mode=0o700), lambda: where.symlink_to(open_to_all)):
        premade()
        forkserver.offer(True)
        assert forkserver.ENV not in os.environ
        assert capfd.readouterr().err == (f"snaketrl: no fork server for this run (File exists: {where}); each job "
                                          f"runs in its own process\n")
        assert list(open_to_all.iterdir()) == [] and (not where.is_dir() or list(where.iterdir()) == [])
        where.rmdir() if not where.is_symlink() else where.unlink()


def offered_here(monkeypatch, where: Path) -> None:
    """An offer by this test's parent process (an ancestor of this one) of the server directory `where`."""
    parent = os.getppid()
    monkeypatch.setenv(forkserver.ENV, f"{parent}:{process_stat(parent)[2]}:{where}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def not_taken(why: str) -> str:
    return f"snaketrl: the fork server did not take this job ({why}); it runs in this process\n"


@pytest.mark.parametrize("made", ["link", "mode", "owner"])
def test_a_job_trusts_only_a_directory_of_its_users_own_with_mode_0700(monkeypatch, tmp_path, capfd, made):
    """What sits at the offered path now, put there by another user or by mistake: a link to a world-writable
    directory, a directory others may enter, another user's directory. The job says why, runs in its own process
    and makes nothing there."""
    if made == "owner" and os.getuid() != 0:
        pytest.skip("making another user's directory needs root")
    where = tmp_path / "server"
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o777)
    if made == "link":
        where.symlink_to(target)
        why = f"{where} is a symbolic link"
    elif made == "mode":
        where.mkdir()
        where.chmod(0o755)
        target = where
        why = f"{where} has mode 755, not 700"
    else:
        where.mkdir(mode=0o700)
        os.chown(where, 65534, 65534)
        target = where
        why = f"{where} belongs to uid 65534, not to this job's 0"
    offered_here(monkeypatch, where)
    assert forkserver.hand_over() is None
    assert capfd.readouterr().err == not_taken(why)
    assert list(target.iterdir()) == []


@pytest.fixture
def short_tmp():
    """A directory whose sockets' paths fit a Unix socket's 108 bytes (pytest's tmp_path may not)."""
    made = tempfile.mkdtemp(prefix="fs-", dir="/tmp")
    yield made
    shutil.rmtree(made)


def test_a_socket_nobody_listens_at_or_of_another_user_is_said_and_not_used(monkeypatch, short_tmp, capfd):
    where = Path(forkserver.new_offer(short_tmp).split(":", 2)[2])
    offered_here(monkeypatch, where)
    sock = where / "socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(sock))  # and closed: what a killed server leaves
    assert forkserver.hand_over() is None
    assert capfd.readouterr().err == not_taken(f"nothing answers at {sock}: its server ended without removing it")
    if os.getuid() == 0:
        os.chown(sock, 65534, 65534)
        assert forkserver.hand_over() is None
        assert capfd.readouterr().err == not_taken(f"{sock} belongs to uid 65534, not to this job's 0")
    assert sorted(p.name for p in where.iterdir()) == ["socket"]  # no lock: no job starts a server here


def test_a_job_that_cannot_fork_the_server_says_why_and_takes_its_directory_away(monkeypatch, tmp_path, capfd):
    where = Path(forkserver.new_offer(str(tmp_path)).split(":", 2)[2])
    offered_here(monkeypatch, where)
    first = forkserver.hand_over()
    assert first == (str(where), os.getppid(), process_stat(os.getppid())[2])
    assert sorted(p.name for p in where.iterdir()) == ["lock"]
    monkeypatch.setattr(forkserver, "PRELOAD", [])
    stop = threading.Event()
    holder = threading.Thread(target=stop.wait, name="holder")
    holder.start()
    try:
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        forkserver.start(*first)
    finally:
        stop.set()
        holder.join()
    assert "holder" in others
    assert capfd.readouterr().err == (f"snaketrl: this job starts no fork server ({len(others)} other Python "
                                      f"thread(s) run ({', '.join(others[:3])}), which a fork would not copy); "
                                      f"every job runs in its own process\n")
    assert not where.exists()
    assert forkserver.hand_over() is None  # a later job
    assert capfd.readouterr().err == not_taken(f"{where} is gone: the server ended, or the first job did not "
                                               f"start it and its log says why")


def test_a_process_is_alive_only_as_the_process_that_started_then(monkeypatch):
    me = os.getpid()
    assert alive(me, process_stat(me)[2])
    assert not alive(me, str(int(process_stat(me)[2]) + 1))  # a later process given this pid

    def refused(pid, signum):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refused)  # another user's process has the pid
    assert not alive(me, process_stat(me)[2])


MARKER = """
import sys
open(sys.argv[1], "w").write("ran")
"""


def knock(sock: Path, request: dict) -> bytes:
    """What a client that trusts nobody does: connect, send the streams and a request at once, read all."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(str(sock))
        try:
            socket.send_fds(conn, [b"R"], [0, 1, 2])
            conn.sendall(json.dumps(request).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):  # the server closed it unread
            pass
        received = b""
        try:
            while data := conn.recv(4096):
                received += data
        except ConnectionResetError:  # after what it said: the server closed it with what it did not read
            pass
        return received


def from_child(run) -> bytes:
    """`run()`'s bytes (or its exception's), run in a forked child of this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.write(write, run())
        except BaseException as err:
            os.write(write, repr(err).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as out:  # until every process that has the pipe ends
        return out.read()


def strangers_request(started, tmp_path) -> tuple[dict, Path]:
    """A request the server would run as a job of its own (its environment, interpreter and flags), whose
    script leaves a file behind."""
    script, _, env = started
    (tmp_path / "marker.py").write_text(MARKER)
    marker = tmp_path / "ran"
    tmp_path.chmod(0o777)
    request = {"argv": [str(tmp_path / "marker.py"), str(marker)], "path": sys.path, "cwd": str(tmp_path),
               "env": env, "nice": 0, "umask": 0o22, "executable": sys.executable, "flags": list(sys.flags)}
    return request, marker


@pytest.mark.skipif(os.getuid() != 0, reason="a process of another user needs root to start")
def test_the_server_refuses_a_process_of_another_user_before_reading_it(started, tmp_path):
    """Even where the directory's guard fails (here: opened to all), the server reads nothing from a process of
    another user, and runs nothing for it."""
    _, where, _ = started
    sock = where / "socket"
    request, marker = strangers_request(started, tmp_path)

    def stranger():
        os.chdir(where)  # its parents are pytest's, 0700: reached from here, the socket's path is "socket"
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        return knock(Path("socket"), request) + b"|" + str(os.getpid()).encode()

    where.chmod(0o711)
    sock.chmod(0o666)
    try:
        reply, pid = from_child(stranger).rsplit(b"|", 1)
    finally:
        where.chmod(0o700)
        sock.chmod(0o600)
    assert reply == b'{"refused": "its process %d runs as uid 65534, not as the server\'s 0"}\n' % int(pid)
    time.sleep(1)
    assert not marker.exists()


def test_the_server_refuses_a_process_outside_the_snakemake_run(started, tmp_path):
    """A process of the same user whose ancestry does not reach the offering process: refused, nothing run."""
    _, where, _ = started
    request, marker = strangers_request(started, tmp_path)

    def orphan():
        middle = os.getpid()
        if os.fork():
            os._exit(0)
        while os.getppid() == middle:  # until the middle process is gone: no descendant of this test's process
            time.sleep(0.01)
        return knock(where / "socket", request) + b"|" + str(os.getpid()).encode()

    reply, pid = from_child(orphan).rsplit(b"|", 1)
    assert reply == b'{"refused": "its process %d is no job of the Snakemake process %d"}\n' % (int(pid), os.getpid())
    time.sleep(1)
    assert not marker.exists()


LIGHT_JOB = """
from snaketrl import forkserver
forkserver.PRELOAD[:] = []  # the server, quickly: torch alone
from snaketrl.imports import start_job
start_job()
"""

SNAKEMAKE = """
import os, subprocess, sys, time
from snaketrl import forkserver
forkserver.offer(True)
print(os.environ[forkserver.ENV], flush=True)
subprocess.run([sys.executable, sys.argv[1]], check=True)
time.sleep(300)
"""


def test_the_server_ends_with_the_snakemake_process_that_offered_it(tmp_path, short_tmp):
    """Killed, and not yet reaped by its parent (a zombie, whose pid still answers kill(pid, 0)): the server
    ends and removes its directory."""
    (tmp_path / "job.py").write_text(LIGHT_JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": short_tmp}
    env.pop(forkserver.ENV, None)
    env.pop("SLURM_JOB_ID", None)
    owner = subprocess.Popen([sys.executable, "-c", SNAKEMAKE, str(tmp_path / "job.py")], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        where = Path(owner.stdout.readline().strip().split(":", 2)[2])
        wait_for(lambda: (where / "socket").exists())
        owner.kill()
        wait_for(lambda: process_stat(owner.pid)[0] == "Z", 30)
        wait_for(lambda: not where.exists(), 30)
    finally:
        owner.kill()
        owner.wait()
