"""Process lifetimes: a process that must not outlive its parent; whether a process is still the one it was."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent ends, however it ends (a SIGKILL at a
    cluster's time limit leaves no handler to run): a launcher's workers end with it, it with the job, and a
    job the fork server runs with the process that handles it (snaketrl.forkserver). Linux only (prctl);
    elsewhere a no-op."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the request: nobody would send it
        os.kill(os.getpid(), sig)


def process_stat(pid: int) -> tuple[str, int, str]:
    """A process's state, parent pid and start time (clock ticks after boot), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold anything
    return fields[0], int(fields[1]), fields[19]


def alive(pid: int, started: str) -> bool:
    """Whether the process that was `pid` at start time `started` (`process_stat`) runs still: the pid's
    process exists, is no zombie, and started then (not a later process given the pid)."""
    try:
        os.kill(pid, 0)
        state, _, start = process_stat(pid)
    except (OSError, ValueError, IndexError):  # PermissionError: another user's process has the pid now
        return False
    return state not in "ZX" and start == started


def descends(pid: int, ancestor: int, started: str) -> bool:
    """Whether process `pid` descends from process `ancestor`, the one that started at `started`."""
    if not alive(ancestor, started):
        return False
    try:
        while pid > 1:
            pid = process_stat(pid)[1]
            if pid == ancestor:
                return True
    except (OSError, ValueError, IndexError):
        pass
    return False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what a CPU job frees for the job's next allocations. By default it gives every
    allocation above 32 MB a fresh mmap and unmaps it at free: one [label tokens, vocabulary] logits tensor of a
    real model (SmolLM2: 1,000 × 49,152 floats, 197 MB) and each temporary the loss makes of it then start on
    untouched pages, and the kernel's page faults and zeroing cost several times the arithmetic (an elementwise
    multiply 113 ms against 16 ms, log_softmax 144 against 41, on a 2-core AMD EPYC). torch's CPU launcher
    (torch.backends.xeon.run_cpu) gets the same from jemalloc told never to give memory back. The price is memory
    held: glibc cannot always reuse a freed block for an aligned one of the same size, so the heap settles above
    the job's need. SFT of SmolLM2 on LIMA (bench/gpu.py, 6 steps): 144 against 128 real tokens/s (two runs
    each), peak RSS 6.76 against 6.06 GB; 120 steps of the loss alone at 300-1,200 tokens: 184 against 228 s,
    peak 2.1 against 1.1 GB, flat from the 20th step on. SNAKETRL_KEEP_FREED_MEMORY=0 leaves glibc's default.
    True where set (Linux with glibc), else False."""
    if os.environ.get("SNAKETRL_KEEP_FREED_MEMORY") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS): its allocator as it is
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, 2 ** 30) and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
