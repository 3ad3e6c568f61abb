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
    the job's need, and where the blocks take new sizes every step it fragments and grows without bound: a job
    whose trainer samples completions gives it back (`give_back_freed_memory`). SFT of SmolLM2 on LIMA
    (bench/gpu.py, 6 steps): 144 against 128 real tokens/s (two runs each), peak RSS 6.76 against 6.06 GB; 120
    steps of the loss alone at 300-1,200 tokens: 184 against 228 s, peak 2.1 against 1.1 GB, flat from the 20th
    step on. SNAKETRL_KEEP_FREED_MEMORY=0 leaves glibc's default. True where set (Linux with glibc), else False."""
    if os.environ.get("SNAKETRL_KEEP_FREED_MEMORY") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS): its allocator as it is
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, 2 ** 30) and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


# Where glibc's own thresholds settle: its mmap threshold rises with each mapped block freed, to at most 32 MiB on a
# 64-bit system (DEFAULT_MMAP_THRESHOLD_MAX), and its trim threshold follows at twice it.
GLIBC_MMAP_THRESHOLD, GLIBC_TRIM_THRESHOLD = 32 * 2 ** 20, 64 * 2 ** 20


def give_back_freed_memory() -> bool:
    """Undo `keep_freed_memory` for the rest of the job, where the job knows its trainer samples completions (GRPO,
    RLOO, online DPO, PPO; snaketrl.train.run): their prompts, caches and completions take new lengths every step,
    so a kept heap cannot reuse its freed blocks, fragments, and grows (config/smollm2.yaml's GRPO jobs: 8.3-13.6
    GB). glibc's thresholds go back to where its defaults settle (a block above 32 MiB mapped afresh and unmapped at
    free; the heap's top given back above 64 MiB), and what the heap kept so far goes back (malloc_trim).
    bench/rl.yaml's GRPO on SmolLM2 (16 completions a step, 1 thread), back to back at load 1 on 2 cores: kept, 5.08
    GB held from step 2 on at 18.9 CPU-s a step (steps 2-4); given back, 2.7-3.4 GB between steps and 3.6-4.5 GB
    peaks at 21.4, 13 % more. At load 6-8, kept 5.07 GB held over 6 steps at 22.8; glibc's default 3.2 GB between
    steps, 4.2-4.3 GB peaks, 27.3; malloc_trim once a step instead, 1.0 GB between steps but peaks of 4.2, 4.9 and
    5.2 GB (the heap still fragments within a step) at 27-28. Trimming once a step would cost the other trainers
    their gain as well: 30 steps of SFT's loss alone (300-1,200 tokens, 1 thread) took 1.08 CPU-s a step kept, 1.46
    trimmed once a step, 1.42 under glibc's default. SNAKETRL_KEEP_FREED_MEMORY=0 (nothing kept) leaves glibc's
    default as it is, =1 keeps it all the same (the faster steps, for a job known to level off). Most of those 13 %
    were GRPO's log-prob chunks of 64 MiB mapped afresh each time: chunks of at most 64 positions (12 MiB at SmolLM2's
    vocabulary; snaketrl.train.logps) come from the heap, 0.1-0.5 CPU-s above kept in a trained pass of ~9.5
    (docs/benchmarks.md). True where done, else False."""
    if os.environ.get("SNAKETRL_KEEP_FREED_MEMORY") in ("0", "1"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator as it is
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD))
    trim(0)
    return done
