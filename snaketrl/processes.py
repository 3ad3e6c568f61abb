"""Process lifetimes: a process that must not outlive its parent."""

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
