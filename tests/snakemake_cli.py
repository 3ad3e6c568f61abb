"""Snakemake's command line for the tests, from a process that has imported Snakemake once.

About 90 tests run `snakemake`, most of them a dry run. A new interpreter spends about 2 CPU-seconds importing
Snakemake and its plugins before it reads a Snakefile, more than most of those commands then take. So each
pytest worker starts one small process (the zygote) that imports Snakemake and nothing else, and forks a child
for every command. The child is a new process as far as the command can tell: its own working directory,
environment, `sys.path` (as `python -m` builds it from $PYTHONPATH), argv, standard streams, niceness and
process group, and its exit status is Snakemake's own. The zygote is single-threaded, so forking it is safe
(forking a pytest-xdist worker, which has threads, is not).

Tests of what a new interpreter does at start-up (a sitecustomize on $PYTHONPATH) start one themselves."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# What a Snakemake command imports before and while it reads a Snakefile (measured: a dry run of the default
# in a process that had imported these imported nothing else but the Snakefile's own), and its plugin
# registries, which scan entry points and import every plugin (the SLURM executor's pulls in pandas).
WARM = ["snakemake.dag", "snakemake.profiles", "snakemake.storage", "snakemake.utils", "smart_open", "jsonschema",
        "fastjsonschema", "nbformat", "platformdirs", "argparse_dataclass", "packaging.version", "difflib", "graphlib"]

ZYGOTE = r"""
import gc, importlib, importlib.util, json, os, signal, sys

for name in WARM:
    try:
        importlib.import_module(name)
    except ImportError:  # another Snakemake version: that module is just not imported ahead
        pass
import snakemake.cli, snakemake.workflow
from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry
from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry
from snakemake_interface_report_plugins.registry import ReportPluginRegistry
from snakemake_interface_storage_plugins.registry import StoragePluginRegistry

for registry in (ExecutorPluginRegistry, LoggerPluginRegistry, ReportPluginRegistry, StoragePluginRegistry):
    registry()
MAIN = importlib.util.find_spec("snakemake.__main__").origin
OWN_PATH = {"", *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
gc.freeze()  # what lives now is never walked again, in the zygote or any child

running = []


def forward(signum, frame):  # Ctrl-C or a kill reaches the command too, as it reaches pytest's own children
    for pid in running:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


signal.signal(signal.SIGINT, forward)
signal.signal(signal.SIGTERM, forward)
replies = os.fdopen(int(sys.argv[1]), "w")
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # The command and its jobs: one process group, killed together on a timeout. Not a session of its own: with
        # the kernel's autogroups, a new session gets its own equal share of the CPU, and its niceness then no
        # longer yields to the other pytest worker.
        os.setpgid(0, 0)
        os.nice(request["nice"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = [request["cwd"], *request["pythonpath"], *(p for p in sys.path if p not in OWN_PATH)]
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                               (2, request["stderr"], os.O_WRONLY)):
            os.dup2(os.open(path, mode), fd)
        replies.close()
        sys.argv = [MAIN, *request["args"]]
        snakemake.workflow.Workflow._rundir = request["cwd"]  # the one value Snakemake takes at import time
        snakemake.cli.main()  # as `python -m snakemake`: its SystemExit ends this process the usual way
        sys.exit(0)
    running[:] = [pid]
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status, usage = os.wait4(pid, 0)
    running.clear()
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                              "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")
    replies.flush()
"""


class Zygote:
    def __init__(self):
        read, write = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", f"WARM = {WARM!r}\n{ZYGOTE}", str(write)],
                                     stdin=subprocess.PIPE, pass_fds=(write,), text=True)
        os.close(write)
        self.replies = os.fdopen(read)

    def _reply(self, timeout):
        if not select.select([self.replies], [], [], timeout)[0]:
            return None
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the Snakemake zygote exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, args, cwd, env, timeout, nice):
        args = [str(a) for a in args]
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch()
            err.touch()
            pythonpath = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            request = {"args": args, "cwd": os.path.abspath(cwd), "env": dict(env), "pythonpath": pythonpath,
                       "nice": nice, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(60)["pid"]
            done = self._reply(timeout)
            if done is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended just now
                    pass
                self._reply(60)
                raise subprocess.TimeoutExpired(["snakemake", *args], timeout, out.read_text(), err.read_text())
            cpu_seconds[0] += done["cpu_s"]
            return subprocess.CompletedProcess(["snakemake", *args], done["returncode"], out.read_text(),
                                               err.read_text())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_zygote: list[Zygote] = []
# The commands' CPU time with their jobs' (bench/cpu_per_test.py adds it to each test's): the zygote's own rusage
# holds it only once the zygote exits.
cpu_seconds = [0.0]


def run(args, cwd, env=None, timeout=900, nice=0) -> subprocess.CompletedProcess:
    """`python -m snakemake *args` in `cwd`: what subprocess.run(..., capture_output=True, text=True) returns."""
    if not _zygote:
        _zygote.append(Zygote())
        atexit.register(_zygote[0].close)
    return _zygote[0].run(args, cwd, os.environ if env is None else env, timeout, nice)
