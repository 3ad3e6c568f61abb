"""Divergence: the first logged step whose loss, gradient norm or headline metric is NaN or infinite.

Nothing in TRL or transformers stops on a non-finite loss, and transformers' `logging_nan_inf_filter` logs a
window of NaN losses as exactly 0.0: a 0.0 loss once the gradient norm has gone non-finite is a NaN too.
Training (snaketrl.train.guard), pretraining and evaluation all read logs here and fail with `Diverged`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from snaketrl.errors import SnaketrlError

HINT = "try a lower learning_rate, max_grad_norm > 0, or bf16 off"
# PPO logs no `loss`: its policy loss stands for it in "last finite loss".
LOSS_KEYS = ("loss", "loss/policy_avg")


@dataclass(frozen=True)
class Divergence:
    step: int
    problem: str  # "grad_norm is nan"
    last_loss: tuple[str, float, int] | None = None  # (key, value, step) of the last finite loss logged


class Diverged(SnaketrlError, RuntimeError):
    pass


def advice(max_grad_norm, bf16: bool) -> str:
    """HINT less what the run's training arguments already do: clipping on, bf16 off."""
    tries = ["a lower learning_rate", *(["max_grad_norm > 0"] if not max_grad_norm or max_grad_norm <= 0 else []),
             *(["bf16 off"] if bf16 else [])]
    return "try " + (", ".join(tries[:-1]) + f", or {tries[-1]}" if len(tries) > 2 else " or ".join(tries))


def describe(subject: str, divergence: Divergence, hint: str = HINT) -> str:
    """`<subject> diverged at step 5: grad_norm is nan (last finite loss 6.20 at step 5; <hint>)`"""
    if divergence.last_loss:
        key, value, step = divergence.last_loss
        last = f"last finite {key} {value:z.2f} at step {step}"
    else:
        last = "no finite loss logged before"
    return f"{subject} diverged at step {divergence.step}: {divergence.problem} ({last}; {hint})"


def finite(value) -> bool:
    """False only for a NaN or infinite number; anything else (None, text, a count) is no sign of divergence."""
    return not isinstance(value, float) or math.isfinite(value)


class Scanner:
    """Reads log entries in order and returns the first that shows divergence. `keys`: what to watch besides
    the losses and grad_norm. `loss_scaling`: fp16's loss scaler skips steps whose gradients overflow, so a
    non-finite grad_norm alone is no divergence there."""

    def __init__(self, keys=(), loss_scaling: bool = False):
        self.keys = tuple(dict.fromkeys((*LOSS_KEYS, "grad_norm", "eval_loss", "train_loss", *keys)))
        self.loss_scaling = loss_scaling
        self.bad_grad = False
        self.last_loss: tuple[str, float, int] | None = None

    def feed(self, entry: dict) -> Divergence | None:
        step = entry.get("step", 0)
        self.bad_grad = self.bad_grad or not finite(entry.get("grad_norm"))
        loss_key = next((k for k in LOSS_KEYS if k in entry), None)
        zeroed = loss_key is not None and entry[loss_key] == 0.0 and self.bad_grad
        if loss_key is not None and finite(entry[loss_key]) and not zeroed:
            self.last_loss = (loss_key, float(entry[loss_key]), step)
        for key in self.keys:
            value = entry.get(key)
            if not finite(value) and not (key == "grad_norm" and self.loss_scaling):
                return Divergence(step, f"{key} is {value}", self.last_loss)
        if zeroed:
            return Divergence(step, f"{loss_key} is nan (logged as 0.0)", self.last_loss)
        return None


def first_divergence(history, keys=(), loss_scaling: bool = False) -> Divergence | None:
    """The first entry of a log_history that shows divergence, or None."""
    scanner = Scanner(keys, loss_scaling)
    return next((d for d in map(scanner.feed, history) if d), None)
