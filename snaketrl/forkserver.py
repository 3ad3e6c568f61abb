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
cannot be forked).

Who talks to whom: the Snakemake process makes the server's directory fresh (never one that was there before),
its user's, mode 0700. A job trusts the directory only as that (looked at without following a link), the socket
in it only as its user's, and the server only where the kernel says it runs as that user (SO_PEERCRED), before it
sends anything. The server serves only a process of its user that descends from the Snakemake process of the
offer, before it reads anything, and ends with that process (its start time tells it from a later one given the
same pid). A job that is not served says why in one line and runs in its own process."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import struct
import sys

from snaketrl.processes import alive, descends, die_with_parent, process_stat

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
    os.environ.pop(ENV, None)
    # Linux only: elsewhere no job could tell this process is its ancestor (/proc).
    if eligible and "SLURM_JOB_ID" not in os.environ and os.path.exists(f"/proc/{os.getpid()}/stat"):
        try:
            os.environ[ENV] = new_offer()
        except OSError as err:
            print(f"snaketrl: no fork server for this run ({err.strerror}: {err.filename}); each job runs in its "
                  f"own process", file=sys.stderr, flush=True)


def new_offer(parent: str | None = None) -> str:
    """An offer by this process (the value of SNAKETRL_FORKSERVER): its pid and start time, and its server's
    directory, made here fresh and 0700 under `parent` (default: the temporary directory) and removed when this
    process exits."""
    import atexit
    import secrets
    import tempfile

    owner = os.getpid()
    started = process_stat(owner)[2]
    where = os.path.join(parent or tempfile.gettempdir(), f"snaketrl-forkserver-{owner}-{secrets.token_hex(4)}")
    os.mkdir(where, 0o700)  # no exist_ok: whatever was there is someone else's
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)  # whatever the umask took away
    finally:
        os.close(fd)
    atexit.register(_withdraw, where, owner)
    return f"{owner}:{started}:{where}"


def _withdraw(where: str, owner: int) -> None:
    """At the offering process's exit: what a server or a job killed on the way left. A server still running
    ends by itself (its socket gone, and its owner)."""
    if os.getpid() == owner:  # not in a forked child that exits through atexit
        _remove(where)


def _remove(where: str) -> None:
    for name in ("socket", "socket.new", "lock"):
        try:
            os.unlink(os.path.join(where, name))
        except OSError:
            pass
    try:
        os.rmdir(where)
    except OSError:
        pass


def hand_over() -> tuple[str, int, str] | None:
    """First in a training-side job, before its imports: where a server runs, have it run this job (never
    returns); where one is offered and none runs yet, answer where this job starts it (`start`, once its own
    imports are trimmed); else None: the job goes on as usual, and says why where a server was offered."""
    where, owner, started = _offer()
    if where is None:
        return None
    if not os.path.lexists(where):
        _unserved(f"{where} is gone: the server ended, or the first job did not start it and its log says why")
        return None
    if untrusted := _untrusted(where, stat.S_ISDIR, 0o700):
        _unserved(untrusted)
        return None
    sock = os.path.join(where, "socket")
    if os.path.lexists(sock):
        _hand_over(sock)  # returns only where the server did not take the job, having said why
        return None
    try:
        os.close(os.open(os.path.join(where, "lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        _unserved("another job is starting it")
        return None
    except OSError as err:
        _unserved(f"{err.strerror}: {err.filename}")
        return None
    return where, owner, started


def _unserved(why: str) -> None:
    print(f"snaketrl: the fork server did not take this job ({why}); it runs in this process", file=sys.stderr,
          flush=True)


def _offer() -> tuple[str | None, int, str]:
    owner, _, rest = os.environ.get(ENV, "").partition(":")
    started, _, where = rest.partition(":")
    if _served or not where or not owner.isdigit() or "SLURM_JOB_ID" in os.environ:
        return None, 0, ""
    if not descends(os.getpid(), int(owner), started):
        return None, 0, ""  # not a local job of that Snakemake process
    return where, int(owner), started


def _untrusted(path: str, kind, mode: int | None = None) -> str | None:
    """Why `path` is not this user's own `kind` of file (stat.S_ISDIR, S_ISSOCK) with `mode`, looked at without
    following a link; None where it is."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"{err.strerror}: {path}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not kind(st.st_mode):
        return f"{path} is not a {'directory' if kind is stat.S_ISDIR else 'socket'}"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this job's {os.getuid()}"
    if mode is not None and stat.S_IMODE(st.st_mode) != mode:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not {mode:o}"
    return None


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket, as the kernel recorded them at its
    connect (or listen)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def _request() -> dict:
    return {"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ),
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "umask": _umask(), "executable": sys.executable,
            "flags": list(sys.flags)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _say(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


# -- the job's side --------------------------------------------------------------------------------------------

def _hand_over(sock: str) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    replies = conn.makefile("rb")
    try:
        reply = _ask(conn, replies, sock)
    except ConnectionRefusedError:
        reply = {"refused": f"nothing answers at {sock}: its server ended without removing it"}
    except (OSError, ValueError) as err:
        reply = {"refused": f"{sock}: {err}"}
    if "pid" not in reply:
        _unserved(reply.get("refused", "no answer"))
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


def _ask(conn: socket.socket, replies, sock: str) -> dict:
    """Connect to the server, make sure it is this user's and that it serves this job, and then send the job:
    the server's answer ({"pid": ...} where it runs it, {"refused": why} where not)."""
    if untrusted := _untrusted(sock, stat.S_ISSOCK):
        return {"refused": untrusted}
    conn.connect(sock)
    pid, uid = _peer(conn)
    if uid != os.getuid():
        return {"refused": f"the server at {sock} (process {pid}) runs as uid {uid}, not as this job's {os.getuid()}"}
    welcome = json.loads(replies.readline() or b"{}")
    if not welcome.get("ready"):
        return welcome
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    socket.send_fds(conn, [b"R"], [0, 1, 2])  # one byte carries the streams; sendall the rest, whatever its size
    conn.sendall(json.dumps(_request()).encode() + b"\n")
    return json.loads(replies.readline() or b"{}")


# -- the server ------------------------------------------------------------------------------------------------

def start(where: str, owner: int, started: str) -> None:
    """Import what jobs import, then fork the server off this job (twice, so that it is no child of this job:
    Snakemake's benchmark would count it), before the job does anything else. The job goes on. Where the
    server cannot be forked, this job says why, takes its directory away (later jobs say it is gone) and goes
    on."""
    import importlib
    import warnings

    before = dict(os.environ)
    try:
        with warnings.catch_warnings():  # a job whose import warns says so in its log; this one would on the console
            warnings.simplefilter("ignore")
            for name in PRELOAD:
                try:
                    importlib.import_module(name)
                except ImportError:
                    pass  # another version's layout: the jobs import it themselves
        why = _unforkable()
    except BaseException:
        _remove(where)
        raise
    if why:
        _remove(where)
        print(f"snaketrl: this job starts no fork server ({why}); every job runs in its own process",
              file=sys.stderr, flush=True)
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    try:
        if os.fork() == 0:
            _serve(where, owner, started, before)
    finally:
        os._exit(0)


def _unforkable() -> str | None:
    """Why this process cannot fork the server, None where it can. No Python thread but this one: the native
    ones the imports start (numpy's and scipy's OpenBLAS servers, pyarrow's jemalloc) wait idle and handle fork
    themselves, as when a DataLoader forks its workers."""
    import threading

    others = [thread.name for thread in threading.enumerate() if thread is not threading.current_thread()]
    if others:
        return f"{len(others)} other Python thread(s) run ({', '.join(others[:3])}), which a fork would not copy"
    import torch

    if torch.cuda.is_available():
        return "a CUDA GPU is visible: a process that has touched CUDA cannot be forked"
    return None


def _serve(where: str, owner: int, started: str, before: dict) -> None:
    import gc

    try:
        gc.freeze()  # what lives now is shared with every child and never walked again
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the first job's streams (its log, Snakemake's pipes) stay that job's
            os.dup2(null, fd)
        os.close(null)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the jobs; the server ends with Snakemake
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock = os.path.join(where, "socket")
        listener.bind(sock + ".new")
        os.chmod(sock + ".new", 0o600)
        listener.listen(16)
        os.rename(sock + ".new", sock)  # ready: a job that sees the socket is served
        # Jobs are compared with the environment the imports found; what the imports set in it (torch's inductor
        # sets TORCHINDUCTOR_CACHE_DIR) is set in each child as its own imports would have.
        me = {"executable": sys.executable, "flags": list(sys.flags), "env": _shared(before),
              "set": {k: v for k, v in os.environ.items() if before.get(k) != v}}
        while alive(owner, started) and os.path.exists(sock):
            if select.select([listener], [], [], 1.0)[0]:
                conn, _ = listener.accept()
                _take(conn, listener, owner, started, me)
            while True:  # reap finished handlers
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break
    finally:
        _remove(where)


def _take(conn: socket.socket, listener: socket.socket, owner: int, started: str, me: dict) -> None:
    """One connection: refused, before a byte of it is read, unless its process is a job of this run (this
    user's, a descendant of the offering process); else handled in a child of the server."""
    pid, uid = _peer(conn)
    if uid != os.getuid():
        refused = f"its process {pid} runs as uid {uid}, not as the server's {os.getuid()}"
    elif not descends(pid, owner, started):
        refused = f"its process {pid} is no job of the Snakemake process {owner}"
    else:
        refused = None
    try:
        _say(conn, {"refused": refused} if refused else {"ready": True})
    except OSError:
        refused = "gone"
    if not refused and os.fork() == 0:
        listener.close()
        try:
            _handle(conn, me)
        finally:
            os._exit(0)
    conn.close()


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
        _say(conn, {"refused": refused})
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
    _say(conn, {"pid": child})
    while True:
        ready = select.select([conn, wake_r], [], [], 1.0)[0]
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            _say(conn, {"status": os.waitstatus_to_exitcode(status)})
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
