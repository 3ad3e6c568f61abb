"""A rerun gives the uninterrupted result: which checkpoint a train job starts from, and what each checkpoint
keeps beyond transformers' own files so that a resumed run ends exactly where an uninterrupted one does.

- A run that finished (its outputs written) leaves no checkpoint to resume: a forced or triggered rerun trains
  from the start (`Attempt.finish`).
- A checkpoint is trusted only when its save ended: the last thing a save writes is `snaketrl_checkpoint.json`,
  listing every file of the checkpoint with its size and sha256, after they are synced to disk. A checkpoint
  without it, or whose files differ from it (a kill, a full disk, a lost node, bytes damaged in place), is
  removed with one log line naming what it lacks, and the rerun resumes from the newest complete one.
  Checkpoints beyond save_total_limit go only after the new one is sealed, so one complete checkpoint is always
  there.
- transformers resumes weights, optimizer, scheduler, RNG and TrainerState, but each attempt restarts the
  running sums it reports at the end: `train_loss` (the loss sum over this attempt's steps only), TRL's
  `num_tokens` and between-log metric lists, TokenCounter's steps, the training-samples file, and the runtime.
  `snaketrl_state_<process>.pt` keeps them with each checkpoint and `Attempt` (a TrainerCallback) puts them
  back. It also skips `eval_on_start` on a resume (that evaluation is already in the log), trains nothing
  when the checkpoint is the last step (transformers would run one step more), and replays the passes of a
  sampler that shuffles from its own generator (TRL's RepeatSampler), which a new trainer starts afresh.
- A save that runs out of disk space ends the job with one line (`DiskFull`).

Tests kill the job at named points (snaketrl.kill_points).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from transformers import TrainerCallback

from snaketrl.errors import DiskFull
from snaketrl.kill_points import check_kill_env, kill_point
from snaketrl.units import human_bytes

log = logging.getLogger("snaketrl.train")

STAMP = "snaketrl_run.json"  # beside the checkpoints: what they were made from, the attempts, finished or not
MARKER = "snaketrl_checkpoint.json"  # in a checkpoint: written last, its files and their sizes
PREFIX = "checkpoint-"
# What every checkpoint holds, to name what a cut-short one lacks when no complete one shows the whole list.
USUAL = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "snaketrl_state_0.pt", MARKER)
# Trainer attributes TRL trainers add up across steps (token counts, metric lists between two logs, GRPO's
# generation cycle and the completions it buffers for the cycle's later steps); any of them a trainer has is
# kept with each checkpoint.
KEPT = ("_total_train_tokens", "_metrics", "_stored_metrics", "stats", "_step", "_buffered_inputs",
        "_entropy_window_stats")
def _step(folder: Path) -> int:
    tail = folder.name[len(PREFIX):]
    return int(tail) if tail.isdigit() else -1


def _seal_of(folder: Path) -> dict:
    """The seal's lists: `files` (name -> size) and `sha256` (name -> digest), both taken after the files were
    synced."""
    from snaketrl.io import file_sha256

    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER]
    return {"files": {str(p.relative_to(folder)): p.stat().st_size for p in files},
            "sha256": {str(p.relative_to(folder)): file_sha256(p) for p in files}}


def _lacks(folder: Path, expected: set[str], verify: bool = True) -> list[str]:
    """What keeps `folder` from being a complete checkpoint: missing files, files of another size or (`verify`)
    of another sha256 than the seal lists (damaged in place: same size, other bytes); [] if none. A seal written
    before snaketrl hashed checkpoints lists no sha256: its sizes are checked."""
    from snaketrl.io import file_sha256

    marker = folder / MARKER
    try:
        seal = json.loads(marker.read_text())
        listed, digests = seal["files"], seal.get("sha256", {}) if verify else {}
    except (OSError, ValueError, KeyError):
        present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        return sorted((expected | {MARKER}) - present) or [MARKER]
    lacking = []
    for name, size in listed.items():
        path = folder / name
        if not path.is_file():
            lacking.append(name)
        elif path.stat().st_size != size:
            lacking.append(f"{name} (has {path.stat().st_size} of {size} bytes)")
        elif name in digests and file_sha256(path) != digests[name]:
            lacking.append(f"{name} (other bytes than sealed: its sha256 differs)")
    return lacking


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _sync(folder: Path) -> None:
    """Flush a checkpoint's files to disk before the marker says they are there (a lost node loses the cache)."""
    for path in [*(p for p in folder.rglob("*") if p.is_file()), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _disk_full(err: BaseException) -> bool:
    """A save that ran out of space: ENOSPC, or torch's zip writer (`unexpected pos`, a short write), or
    safetensors' wrapped IO error."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    return any(s in text for s in ("No space left on device", "unexpected pos", "PytorchStreamWriter failed"))


def _plain(value):
    """Containers as plain dicts and lists (a defaultdict's factory may be a lambda: not picklable)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _refill(target, saved):
    """Put `saved` back into the trainer's own container, keeping its types (a defaultdict stays one)."""
    if isinstance(target, list):
        target[:] = saved
        return target
    old = dict(target)
    target.clear()
    for key, value in saved.items():
        inner = old[key] if key in old else (target[key] if isinstance(target, defaultdict) else None)
        target[key] = _refill(inner, value) if isinstance(inner, (dict, list)) else value
    return target


class Attempt(TrainerCallback):
    """One attempt at training a run. Made before the model loads, it decides where training starts
    (`resume`: a checkpoint path or None) and says why in the log and in `attempts`; `attach` then hooks the
    built trainer, and `finish` marks the run done once its outputs are written."""

    def __init__(self, checkpoint_dir, parts: dict[str, str], run: str = "?"):
        check_kill_env()
        self.dir, self.run, self.parts = Path(checkpoint_dir), run, parts
        self.resume, self.attempts, self._stale = self._start()
        self.saved = self._load(self.resume)  # what the checkpoint kept beyond transformers' files
        self.trainer = self.counter = None
        self.samples = self.dir / "training_samples.jsonl"
        self._began = self._eval_on_start = None
        self._trained = False

    # -- where an attempt starts

    def _start(self) -> tuple[str | None, list[dict], list[Path]]:
        """The checkpoint to resume (None: step 0), the attempts so far with this one last, and what `attach`
        removes. It only reads: every process of a launched job decides from the same files (the log says why)."""
        from snaketrl.train.guard import MARKER as DIVERGED
        from snaketrl.train.guard import refuse_resume

        stamp = self.dir / STAMP
        saved = json.loads(stamp.read_text()) if stamp.is_file() else {}
        old = saved.get("parts", {})
        earlier = any(self.dir.glob(f"{PREFIX}*")) or (self.dir / DIVERGED).is_file()
        attempts = saved.get("attempts", []) if old == self.parts else []
        complete, set_aside = [], {}
        if earlier and old != self.parts:
            changed = sorted(k for k in {*old, *self.parts} if old.get(k) != self.parts.get(k))
            reason = f"checkpoints in {self.dir} were made with another {', '.join(changed)}: starting over"
            stale = [self.dir]
        else:
            refuse_resume(self.dir, self.run)  # the same config and inputs diverged here: stop before loading
            folders = sorted((f for f in self.dir.glob(f"{PREFIX}*") if f.is_dir() and _step(f) >= 0), key=_step)
            if saved.get("finished"):
                reason = "it finished before (a forced or triggered rerun): starting over"
                attempts, stale = [], folders  # its checkpoints, if their removal was cut short
            else:
                set_aside = self._cut_short(folders)
                complete = [f for f in folders if f.name not in set_aside]
                stale = [self.dir / name for name in set_aside]
                if complete:
                    reason = f"the last attempt was cut short: resuming from {complete[-1].name}"
                elif attempts or set_aside:
                    reason = "the last attempt was cut short before a complete checkpoint: starting over"
                else:
                    reason = "first attempt"
        start = _step(complete[-1]) if complete else 0
        reason += f" at step {start}" + "".join(f"; {name} set aside" for name in set_aside)
        log.log(logging.INFO if reason.startswith("first attempt") else logging.WARNING, "%s: %s", self.run, reason)
        resume = str(complete[-1]) if complete else None
        return resume, [*attempts, {"started_at_step": start, "reason": reason, "checkpoint": resume,
                                    "set_aside": set_aside,
                                    "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}], stale

    def _cut_short(self, folders: list[Path]) -> dict[str, str]:
        """Checkpoint name -> what it lacks, for each one cut short; one log line each."""
        expected = set(USUAL)
        for folder in folders:
            if (folder / MARKER).is_file():
                try:
                    expected = set(json.loads((folder / MARKER).read_text())["files"]) | {MARKER}
                except (ValueError, KeyError):
                    pass
        aside, resumable = {}, False
        # Newest first: once one verifies, older ones are only checked for their files and sizes (hashing every
        # kept checkpoint would read gigabytes more on each resume for ones it does not start from).
        for folder in reversed(folders):
            lacking = _lacks(folder, expected, verify=not resumable)
            resumable = resumable or not lacking
            if lacking:
                aside[folder.name] = ", ".join(lacking)
                log.warning("%s: %s was cut short (it lacks %s): set aside (removed), never resumed from", self.run,
                            folder, aside[folder.name])
        return {f.name: aside[f.name] for f in folders if f.name in aside}

    def _stamp(self, finished: bool) -> None:
        from snaketrl.io import write_json

        write_json({"parts": self.parts, "finished": finished, "attempts": self.attempts}, self.dir / STAMP)

    def _complete(self) -> list[Path]:
        return sorted((f for f in self.dir.glob(f"{PREFIX}*") if _step(f) >= 0 and (f / MARKER).is_file()),
                      key=_step)

    def _load(self, checkpoint: str | None, process_index: int = 0) -> dict:
        import torch

        if checkpoint is None:
            return {}
        return torch.load(Path(checkpoint) / self._state_name(process_index), map_location="cpu", weights_only=True)

    @staticmethod
    def _state_name(process_index: int) -> str:
        return f"snaketrl_state_{process_index}.pt"

    # -- hooking the trainer

    def attach(self, trainer, counter=None, samples_log=None) -> None:
        """Hook a built trainer (its callbacks already hold this one): checkpoint saves that seal and can
        report a full disk, the kill points, the state the checkpoint kept. `counter`: the TokenCounter whose
        `steps` are kept; `samples_log`: training_samples' SampleLog, whose live file goes back to the
        checkpoint's rows."""
        self.trainer, self.counter = trainer, counter
        if self.saved and trainer.args.process_index:
            self.saved = self._load(self.resume, trainer.args.process_index)
        if counter is not None:
            counter.steps[:] = self.saved.get("token_steps", [])
        trainer.accelerator.wait_for_everyone()  # every process has decided before anything is removed
        if trainer.is_world_process_zero():
            self._tidy()
        trainer.accelerator.wait_for_everyone()
        if samples_log is not None:
            samples_log.reconciled = True  # the file now ends where the checkpoint did
        save, save_rest = trainer._save_checkpoint, trainer._save_optimizer_and_scheduler

        def save_checkpoint(model, trial):
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

            folder = Path(trainer._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
            (folder / MARKER).unlink(missing_ok=True)  # a save over an existing checkpoint: untrusted until sealed
            # transformers rotates old checkpoints out before this one is sealed (under save_total_limit: 1 a
            # kill then would leave none complete): rotate after the seal instead.
            limit, trainer.args.save_total_limit = trainer.args.save_total_limit, None
            try:
                save(model, trial)
                self._save_state(folder)
                trainer.accelerator.wait_for_everyone()
                if trainer.is_world_process_zero():
                    self._seal(folder)
            except Exception as err:
                if not _disk_full(err):
                    raise
                raise self._disk_full(folder) from err
            finally:
                trainer.args.save_total_limit = limit
            if trainer.args.should_save:
                rotate_checkpoints(output_dir=str(folder.parent), save_total_limit=limit, use_mtime=True,
                                   best_model_checkpoint=trainer.state.best_model_checkpoint)
            kill_point("after_checkpoint", trainer.state.global_step)
            if trainer.state.global_step >= trainer.state.max_steps:
                kill_point("after_last_checkpoint")

        def save_rest_of_checkpoint(output_dir):
            kill_point("during_checkpoint_save", trainer.state.global_step)
            return save_rest(output_dir)

        trainer._save_checkpoint = save_checkpoint
        trainer._save_optimizer_and_scheduler = save_rest_of_checkpoint

    def _tidy(self) -> None:
        """Remove what this attempt does not resume from, record the attempt, and cut the live samples file
        back to the checkpoint's rows (all of them when starting over)."""
        from snaketrl.io import atomic

        for path in self._stale:
            shutil.rmtree(path, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stamp(finished=False)
        if self.samples.is_file():
            lines = self.samples.read_text(encoding="utf-8").splitlines(keepends=True)
            with atomic(self.samples) as tmp:
                tmp.write_text("".join(lines[:self.saved.get("samples", 0)]), encoding="utf-8")

    def _save_state(self, folder: Path) -> None:
        import torch

        trainer = self.trainer
        state = {"step": trainer.state.global_step, "seconds": self._seconds(),
                 "token_steps": list(self.counter.steps) if self.counter is not None else [],
                 "samples": self._sample_rows(),
                 "trainer": {name: _plain(getattr(trainer, name)) for name in KEPT if hasattr(trainer, name)}}
        if hasattr(trainer, "_total_loss_scalar"):  # transformers' loop: the loss sums behind `train_loss`
            state["loss"] = {"total": trainer._total_loss_scalar, "pending": float(trainer._tr_loss),
                             "last_logged": trainer._globalstep_last_logged}
        torch.save(state, folder / self._state_name(trainer.args.process_index))

    def _sample_rows(self) -> int:
        if not self.samples.is_file():
            return 0
        with open(self.samples, "rb") as f:
            return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))

    def _seal(self, folder: Path) -> None:
        from snaketrl.io import atomic

        _sync(folder)
        with atomic(folder / MARKER) as tmp:
            tmp.write_text(json.dumps({"step": _step(folder), **_seal_of(folder)}, indent=2))
        _sync(folder)

    def _disk_full(self, folder: Path) -> DiskFull:
        complete = [f for f in self._complete() if f != folder]
        if complete:
            need = f"about {human_bytes(_size(complete[-1]))} (the size of {complete[-1].name})"
        else:
            trainer = self.trainer
            weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
            moments = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                          for t in s.values() if hasattr(t, "numel"))
            need = f"more than {human_bytes(weights + moments)} (its trainable weights and optimizer state alone)"
        shutil.rmtree(folder, ignore_errors=True)  # nothing half-written stays to take space or be trusted
        free = shutil.disk_usage(self.dir if self.dir.exists() else self.dir.parent).free
        where = complete[-1].name if complete else "the start"
        return DiskFull(f"run '{self.run}': no space left on device for checkpoint {folder}: it needs {need}, "
                        f"{human_bytes(free)} free there; free some space and rerun: it resumes from {where}")

    def _seconds(self) -> float:
        return self.saved.get("seconds", 0.0) + (time.perf_counter() - self._began if self._began else 0.0)

    # -- the callback

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._began = time.perf_counter()
        trainer = self.trainer
        if not self.saved:
            return
        for name, value in self.saved.get("trainer", {}).items():
            current = getattr(trainer, name, None)
            setattr(trainer, name, _refill(current, value) if isinstance(current, (dict, list)) else value)
        if getattr(trainer, "own_loop", False):  # snaketrl.train.ppo: resumes the rest itself
            return
        # transformers' loop restarts its loss sums on a resume, and divides by this attempt's steps
        loss = self.saved["loss"]
        trainer._total_loss_scalar = loss["total"]
        trainer._tr_loss.fill_(loss["pending"])
        trainer._globalstep_last_logged = loss["last_logged"]
        trainer._initial_global_step = 0  # train_loss and the rates count every step; combine() fixes the time
        self._eval_on_start, args.eval_on_start = args.eval_on_start, False  # logged before the checkpoint
        if state.global_step >= state.max_steps:
            # Training is done; the loop would still run one more step before it checks. Put the RNG back
            # where the uninterrupted run left it for the final evaluation.
            trainer._load_rng_state(self.resume)
            trainer._run_epoch = lambda **_: None
            control.should_training_stop = True
        elif train_dataloader is not None:
            self._replay_passes(trainer, train_dataloader, state.global_step)

    @staticmethod
    def _replay_passes(trainer, dataloader, step: int) -> None:
        """A sampler that shuffles from its own generator and is never re-seeded per epoch (TRL's RepeatSampler)
        draws each pass's order when the pass begins: a new trainer's generator would give a resumed epoch
        the first epoch's order. Draw the finished epochs' orders first, as the uninterrupted run did."""
        import torch
        from accelerate.data_loader import get_sampler

        sampler = get_sampler(dataloader)
        if not isinstance(getattr(sampler, "generator", None), torch.Generator) or hasattr(sampler, "set_epoch"):
            return
        per_epoch = trainer.set_initial_training_values(trainer.args, dataloader)[1]
        for _ in range(step // per_epoch):
            next(iter(sampler), None)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        kill_point("mid_step", state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if getattr(self.trainer, "own_loop", False):  # PPO's loop has no pre-optimizer event
            kill_point("mid_step", state.global_step)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self._trained:
            kill_point("final_eval")

    def on_train_end(self, args, state, control, **kwargs):
        if self._eval_on_start is not None:
            args.eval_on_start = self._eval_on_start
        self.trainer.__dict__.pop("_run_epoch", None)
        self._trained = True

    # -- after training

    def combine(self, metrics: dict, state) -> None:
        """The whole run's time where this attempt's stands (`metrics` and the log's closing summary): earlier
        attempts' training time up to the checkpoint plus this one's, and the per-second rates over it."""
        before = self.saved.get("seconds", 0.0)
        attempt = metrics.get("train_runtime")
        if not before or attempt is None:
            return
        whole = round(before + attempt, 4)
        summary = state.log_history[-1] if state.log_history and "train_runtime" in state.log_history[-1] else {}
        for entry in (metrics, summary):
            for key, value in list(entry.items()):
                if key.startswith("train_") and key.endswith("_per_second") and value is not None:
                    entry[key] = round(value * attempt / whole, 3) if whole else value
            if entry:
                entry["train_runtime"] = whole

    def finish(self) -> None:
        """The outputs are written: no later rerun resumes this run's checkpoints (they are removed)."""
        self._stamp(finished=True)
        for folder in self.dir.glob(f"{PREFIX}*"):
            shutil.rmtree(folder, ignore_errors=True)
        self.samples.unlink(missing_ok=True)
