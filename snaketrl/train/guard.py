"""Stops a diverging run (snaketrl.divergence) at the first log that shows it, and keeps it from resuming.

A step's NaN loss and gradients need not show in any log: transformers' `logging_nan_inf_filter` logs such a
loss as the running average, and `grad_norm` is logged for the last step of a window only (or never, where a run
ends before its first logging step), while clipping a NaN norm makes every gradient NaN and the optimizer step
every weight. So wherever a step is logged, evaluated, saved or the last one, the guard also checks that the
trainable weights (LoRA's, a few MB) are finite: one fused norm and one device sync there.

The run's checkpoints stay for inspection; a marker beside them (`diverged.json`: where, what, the log
history) makes a rerun with the same config and inputs refuse to train on, while a changed config or input
starts over as any other change does (snaketrl.train.checkpoints.Attempt).
"""

from __future__ import annotations

import math
from pathlib import Path

from transformers import TrainerCallback

from snaketrl.divergence import HINT, Divergence, Diverged, Scanner, advice, describe
from snaketrl.io import read_json, write_json
from snaketrl.trainers import REGISTRY

MARKER = "diverged.json"
# torch.multinomial's check: generation sampled from a policy whose probabilities went non-finite, the way a
# diverged GRPO or PPO policy usually shows itself, one step after the update that broke it.
NONFINITE_SAMPLING = "probability tensor contains either `inf`, `nan` or element < 0"


def watched(trainer: str) -> tuple[str, ...]:
    """The trainer's curve and headline metrics, for training and evaluation."""
    spec = REGISTRY[trainer]
    keys = (spec.overlay, *spec.headline)
    return tuple(dict.fromkeys((*keys, *(k if k.startswith("eval_") else f"eval_{k}" for k in keys))))


class DivergenceGuard(TrainerCallback):
    """Scans every log; at the first divergence stops training, skips the step's evaluation and checkpoint (a
    checkpoint of the broken weights would rotate the last finite one out under save_total_limit), and
    `check` then writes the marker and raises `Diverged`."""

    def __init__(self, run: str, trainer: str, checkpoint_dir, loss_scaling: bool = False):
        self.run, self.checkpoint_dir = run, Path(checkpoint_dir)
        self.keys, self.loss_scaling = watched(trainer), loss_scaling
        self.scanner = Scanner(self.keys, loss_scaling)
        self.divergence: Divergence | None = None
        self.broken: Divergence | None = None  # non-finite weights, named unless this step's log names more
        self.state, self.hint = None, HINT

    def _feed(self, entry: dict) -> None:
        if self.divergence is None:
            self.divergence = self.scanner.feed(entry) or self.broken

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run's history is back in `state` by now: "last finite loss" may lie before the resume.
        self.state, self.scanner = state, Scanner(self.keys, self.loss_scaling)
        self.divergence = self.broken = None
        self.hint = advice(args.max_grad_norm, args.bf16)
        for entry in state.log_history:
            self._feed(entry)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # Every process reaches here with the same control, so a sharded check can agree across them.
        if model is None or not (control.should_log or control.should_evaluate or control.should_save
                                 or control.should_training_stop):
            return
        problem = nonfinite_weights(model)
        if problem is not None:
            self.broken = Divergence(state.global_step, problem, self.scanner.last_loss)
            if not control.should_log:  # else on_log feeds this step's log first
                self._feed({})
            self._stop(control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._feed({**(logs or {}), "step": state.global_step})
        if self.divergence is not None:
            self._stop(control)

    @staticmethod
    def _stop(control) -> None:
        control.should_training_stop = True
        control.should_evaluate = control.should_save = False

    def check(self, metrics: dict | None = None) -> None:
        """Raise `Diverged` (after writing the marker) if a log, or `metrics`, showed divergence."""
        if metrics is not None and self.state is not None:
            self._feed({**metrics, "step": self.state.global_step})
        if self.divergence is not None or self.broken is not None:
            self._fail()

    def failed(self, err: BaseException) -> None:
        """Raise `Diverged` from `err` if it is generation sampling from non-finite probabilities; else return."""
        if NONFINITE_SAMPLING not in str(err):
            return
        step = self.state.global_step + 1 if self.state is not None else 1
        self.divergence = self.divergence or Divergence(
            step, "the policy's sampling probabilities are nan or inf", self.scanner.last_loss)
        self._fail(err)

    def _fail(self, cause: BaseException | None = None):
        if self.divergence is None:
            self.divergence = self.broken
        message = describe(f"run '{self.run}'", self.divergence, self.hint)
        if self.state is None or self.state.is_world_process_zero:
            # Atomic: a kill mid-write leaves no marker rather than a torn one (refuse_resume reads it).
            history = self.state.log_history if self.state is not None else []
            write_json({"run": self.run, "step": self.divergence.step, "problem": self.divergence.problem,
                        "hint": self.hint, "message": message, "log_history": history}, self.checkpoint_dir / MARKER)
        raise Diverged(message) from cause


def refuse_resume(checkpoint_dir, run: str) -> None:
    """Raise `Diverged` if the run in `checkpoint_dir` (made from this same config and inputs) diverged."""
    marker = Path(checkpoint_dir) / MARKER
    if not marker.is_file():
        return
    try:
        saved = read_json(marker)
        where = f"at step {saved['step']} ({saved['problem']})"
        hint = saved.get("hint", HINT)  # markers written before the advice followed the config have none
    except (OSError, ValueError, KeyError, TypeError) as err:
        # Only a divergence writes the marker, so one that cannot be read (torn by a version that wrote it in
        # place, or damaged since) still says the run diverged: refuse as for a whole one, saying what is missing.
        where, hint = f"(its marker {marker} is unreadable: {type(err).__name__}: {err})", HINT
    raise Diverged(f"run '{run}': its checkpoints in {checkpoint_dir} diverged {where} with this same config and "
                   f"inputs; change its config ({hint}) or delete {checkpoint_dir} to start over")


def nonfinite_weights(model) -> str | None:
    """"the trainable weights are nan" (or inf) where one of them is, else None; agreed across processes."""
    import torch

    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    # A finite weight too large to square in its dtype reads as inf here: diverged all the same.
    norm = torch.nn.utils.get_total_norm(params, foreach=True).float()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # NaN does not survive a MAX reduce reliably: reduce the sum, NaN or inf anywhere stays so.
        torch.distributed.all_reduce(norm)
    value = norm.item()
    return None if math.isfinite(value) else f"the trainable weights are {value}"
