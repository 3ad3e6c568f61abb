"""Kill points: a test-only switch that interrupts a job at a named point, so that each interruption case is
deterministic (tests/test_interruptions.py, tests/test_distributed_training.py).

SNAKETRL_KILL_AT=<point>[:<step>][@<rank>] (a point of `KILL_POINTS`) makes the process SIGKILL itself there (with
@<rank>, only that process of a launched job). SNAKETRL_KILL_SIGNAL=SIGSTOP makes it stop there instead, as a hung
one would.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from snaketrl.errors import SnaketrlError

log = logging.getLogger("snaketrl.kill_points")

KILL_ENV = "SNAKETRL_KILL_AT"
KILL_POINTS = {
    "mid_step": "in optimizer step N, its gradients computed, before its weights change (PPO: after its update, "
                "before step end and checkpoint)",
    "during_checkpoint_save": "while checkpoint N is saved: its weights written, nothing else",
    "after_checkpoint": "right after checkpoint N is complete",
    "after_last_checkpoint": "right after the last step's checkpoint is complete",
    "final_eval": "in the final evaluation, after its first batch",
    "writing_outputs": "after the adapter and trainer_state.json are written, before metrics.json and the manifest",
}


def _kill_at() -> tuple[str, str, str] | None:
    """SNAKETRL_KILL_AT as (point, step, rank); the last two may be ''."""
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return None
    rest, _, rank = wanted.partition("@")
    point, _, at = rest.partition(":")
    return point, at, rank


def kill_point(name: str, step: int | None = None) -> None:
    """SIGKILL this process (or send it SNAKETRL_KILL_SIGNAL) if SNAKETRL_KILL_AT names this point (and this
    step, and this process's rank, where it gives them): a test-only switch that makes an interruption happen
    exactly here."""
    wanted = _kill_at()
    if not wanted:
        return
    point, at, rank = wanted
    if point == name and (not at or step is None or int(at) == step) and (
            not rank or int(rank) == int(os.environ.get("RANK", "0"))):
        sig = signal.Signals[os.environ.get("SNAKETRL_KILL_SIGNAL", "SIGKILL")]
        log.warning("%s=%s: %s this process at %s", KILL_ENV, os.environ[KILL_ENV],
                    "killing" if sig == signal.SIGKILL else f"sending {sig.name} to",
                    name if step is None else f"{name} {step}")
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)


def check_kill_env() -> None:
    wanted = _kill_at()
    if not wanted:
        return
    point, at, rank = wanted
    if point not in KILL_POINTS or (at and not at.isdigit()) or (rank and not rank.isdigit()) or \
            os.environ.get("SNAKETRL_KILL_SIGNAL", "SIGKILL") not in signal.Signals.__members__:
        raise SnaketrlError(f"{KILL_ENV}={os.environ[KILL_ENV]!r}: expected <point>, <point>:<step> or either "
                            f"with @<rank>, a point of {', '.join(KILL_POINTS)} (and SNAKETRL_KILL_SIGNAL a "
                            f"signal's name)")
