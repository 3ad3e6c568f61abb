"""One warm process per workflow run that forks its tiny models' training-side jobs, so that torch, transformers,
peft, TRL and datasets are imported once instead of in each job.

A tiny model's job spends most of its CPU importing them: about 8 of the 10 to 15 CPU-seconds of each of the
default's 28 training-side jobs (tiny_model, pretrain, train, merge, evaluate). Where every model is tiny and jobs
run on this machine's CPUs, the Snakefile offers a fork server (`offer`: an environment variable naming the
Snakemake process and a socket). The first job to come (`snaketrl.imports.start_job`) imports those libraries,
forks the server off itself and runs its own job as usual. Every later job hands its script to the server: the
server forks a child that takes the job's standard streams, working directory, environment, niceness, argv and
`sys.path`, and runs the same script (Snakemake's copy with its preamble) as `python script` would; the job's
process waits for it, passes on the signals it gets, and exits with the child's status. If the job's process is
killed (SIGKILL), the child is killed with it. Results are the same bits either way: each job seeds itself and
sets its threads (the default's every logged number compared, served and not: docs/development.md).

What stays the job process's own: Snakemake's benchmark file of a served job records the waiting process (its
wall time is the job's; its CPU and memory columns are not), so runs record their own peak memory
(`peak_rss_bytes` in metrics.json) and `SNAKETRL_FORKSERVER=0` turns serving off. Never served: jobs under SLURM
or on another machine (the Snakemake process must be an ancestor of the job), jobs whose interpreter, its flags
or environment variables differ from the first job's (Snakemake's per-job threads and tmpdir aside; such a job
says so and runs in its own process), and jobs where a CUDA GPU is visible (a process that has touched CUDA
cannot be forked)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

from snaketrl.processes import die_with_parent

ENV = "SNAKETRL_FORKSERVER"
# What Snakemake sets for each job (snakemake.shell): the job applies its threads itself (torch.set_num_threads).
PER_JOB = {"OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "TMPDIR", "TMP", "TEMPDIR", "TEMP"}
# What a training-side job imports: the third-party libraries only, so each job imports this checkout's own code
# as it is when the job starts.
PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "transformers.trainer", "peft", "datasets",
           "accelerate", "trl", "trl.trainer.sft_trainer", "trl.trainer.dpo_trainer", "trl.trainer.grpo_trainer",
           "trl.trainer.reward_trainer", "trl.experimental.ppo"]
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_served: list[bool] = []  # [True] in a served child: its script's start_job must not hand it on again


def offer(eligible: bool) -> None:
    """At parse time, in the Snakemake process: offer a fork server to this run's jobs, or withdraw an offer
    inherited from another Snakemake process (a SLURM job's own Snakemake, a nested run)."""
    if os.environ.get(ENV) == "0":
        return
    if eligible and "SLURM_JOB_ID" not in os.environ:
        import secrets
        import tempfile

        where = os.path.join(tempfile.gettempdir(), f"snaketrl-forkserver-{os.getpid()}-{secrets.token_hex(4)}")
        os.environ[ENV] = f"{os.getpid()}:{where}"
    else:
        os.environ.pop(ENV, None)


def hand_over() -> tuple[str, int] | None:
    """First in a training-side job, before its imports: where a server runs, have it run this job (never
    returns); where one is offered and none runs yet, answer where this job starts it (`start`, once its own
    imports are trimmed); else None: the job goes on as usual."""
    where, owner = _offer()
    if where is None:
        return None
    sock = os.path.join(where, "socket")
    if os.path.exists(sock):
        _hand_over(sock)  # returns only where the server could not take the job
        return None
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        os.close(os.open(os.path.join(where, "lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return None  # another job is starting it
    return where, owner


def _offer() -> tuple[str | None, int]:
    value = os.environ.get(ENV, "")
    owner, _, where = value.partition(":")
    if _served or not where or not owner.isdigit() or "SLURM_JOB_ID" in os.environ:
        return None, 0
    if not _ancestor(int(owner)):
        return None, 0  # not a local job of that Snakemake process
    return where, int(owner)


def _ancestor(owner: int) -> bool:
    pid = os.getppid()
    try:
        while pid > 1:
            if pid == owner:
                return True
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return False


def _request() -> dict:
    return {"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ),
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "umask": _umask(), "executable": sys.executable,
            "flags": list(sys.flags)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- the job's side --------------------------------------------------------------------------------------------

def _hand_over(sock: str) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock)
    except OSError:
        conn.close()
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    socket.send_fds(conn, [b"R"], [0, 1, 2])  # one byte carries the streams; sendall the rest, whatever its size
    conn.sendall(json.dumps(_request()).encode() + b"\n")
    replies = conn.makefile("rb")
    reply = json.loads(replies.readline() or b"{}")
    if "pid" not in reply:
        print(f"snaketrl: the fork server did not take this job ({reply.get('refused', 'no answer')}); it runs "
              f"in this process", file=sys.stderr, flush=True)
        conn.close()
        return
    for signum in FORWARDED:  # to the job, as if sent to it
        signal.signal(signum, lambda signum, frame: conn.sendall(b"%d\n" % signum))
    line = replies.readline()
    if not line:
        print("snaketrl: the fork server ended while it ran this job", file=sys.stderr, flush=True)
        os._exit(1)
    status = json.loads(line)["status"]
    if status < 0:  # killed by a signal: so is this process, for Snakemake to see the same
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


# -- the server ------------------------------------------------------------------------------------------------

def start(where: str, owner: int) -> None:
    """Import what jobs import, then fork the server off this job (twice, so that it is no child of this job:
    Snakemake's benchmark would count it), before the job does anything else. The job goes on."""
    import importlib
    import warnings

    before = dict(os.environ)
    with warnings.catch_warnings():  # a job whose import warns says so in its log; this one would on the console
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # another version's layout: the jobs import it themselves
    import threading

    import torch

    # No Python thread but this one. The native ones the imports start (numpy's and scipy's OpenBLAS servers,
    # pyarrow's jemalloc) wait idle and handle fork themselves, as when a DataLoader forks its workers.
    if torch.cuda.is_available() or threading.active_count() != 1:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    try:
        if os.fork() == 0:
            _serve(where, owner, before)
    finally:
        os._exit(0)


def _serve(where: str, owner: int, before: dict) -> None:
    import gc

    gc.freeze()  # what lives now is shared with every child and never walked again
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the first job's streams (its log, Snakemake's pipes) stay that job's
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the jobs; the server ends with Snakemake
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock = os.path.join(where, "socket")
    listener.bind(sock + ".new")
    listener.listen(16)
    os.rename(sock + ".new", sock)  # ready: a job that sees the socket is served
    # Jobs are compared with the environment the imports found; what the imports set in it (torch's inductor
    # sets TORCHINDUCTOR_CACHE_DIR) is set in each child as its own imports would have.
    me = {"executable": sys.executable, "flags": list(sys.flags), "env": _shared(before),
          "set": {k: v for k, v in os.environ.items() if before.get(k) != v}}
    try:
        while _alive(owner) and os.path.exists(sock):
            if select.select([listener], [], [], 1.0)[0]:
                conn, _ = listener.accept()
                if os.fork() == 0:
                    listener.close()
                    try:
                        _handle(conn, me)
                    finally:
                        os._exit(0)
                conn.close()
            while True:  # reap finished handlers
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break
    finally:
        for name in ("socket", "lock"):
            try:
                os.unlink(os.path.join(where, name))
            except OSError:
                pass
        try:
            os.rmdir(where)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _shared(env) -> dict:
    return {k: v for k, v in env.items() if k not in PER_JOB and k != ENV}


def _refusal(request: dict, me: dict) -> str | None:
    if request["executable"] != me["executable"]:
        return f"another interpreter: {request['executable']}"
    if request["flags"] != me["flags"]:
        return "other interpreter flags"
    env = _shared(request["env"])
    differ = sorted(k for k in env.keys() | me["env"].keys() if env.get(k) != me["env"].get(k))
    if differ:
        return f"other environment variables: {', '.join(differ[:5])}"
    return None


def _handle(conn: socket.socket, me: dict) -> None:
    """One job: fork its child, pass on the signals its process sends, kill the child if that process dies."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    message = conn.makefile("rb").readline()
    if len(fds) != 3 or not message.endswith(b"\n"):
        return
    request = json.loads(message)
    if refused := _refusal(request, me):
        conn.sendall(json.dumps({"refused": refused}).encode() + b"\n")
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    child = os.fork()
    if child == 0:
        # Killed when its handler dies: a kill of Snakemake's whole process group (a test's timeout, the OOM
        # killer) reaches the job's process, the server and its handlers, not this group of its own.
        die_with_parent()
        signal.set_wakeup_fd(-1)
        for fd in (wake_r, wake_w):
            os.close(fd)
        _child(conn, fds, request, me["set"])  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
    while True:
        ready = select.select([conn, wake_r], [], [], 1.0)[0]
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            return
        if wake_r in ready:
            os.read(wake_r, 512)
        if conn in ready:
            data = conn.recv(512)
            if not data:  # the job's process is gone: so is the job, and what it started
                _kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                return
            for signum in data.split():
                _kill(child, int(signum))


def _kill(child: int, signum: int) -> None:
    try:
        os.killpg(child, signum)
    except ProcessLookupError:
        pass


def _child(conn: socket.socket, fds: list[int], request: dict, imported: dict) -> None:
    """Become the job's process, as `python script` would have started it, and run its script."""
    import random
    import tempfile

    os.setpgid(0, 0)  # the job and what it starts: one group, killed together
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**imported, **request["env"]})
    os.umask(request["umask"])
    try:
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    except OSError:
        pass
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv[:] = request["argv"]
    sys.path[:] = request["path"]
    tempfile.tempdir = None  # read again from this job's TMPDIR
    random.seed()  # a new interpreter's state, not the server's
    _served.append(True)
    os._exit(_run(request["argv"][0]))


def _run(script: str) -> int:
    """Run `script` as __main__ and end as the interpreter ends: its exit status, a traceback for an exception,
    threads joined, atexit handlers run, streams flushed."""
    import atexit
    import runpy
    import threading

    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code & 0xFF
