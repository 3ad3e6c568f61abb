"""Completions sampled during training (GRPO/RLOO's generation batches, PPO's sample generations), kept as
JSON Lines for the evaluation database's `training_samples` table.

What TRL 1.12 exposes, and how this hooks in:
- GRPOTrainer/RLOOTrainer fill `trainer._logs` (deques sized to one generation batch: prompt, completion,
  rewards per function, advantages) in `_generate_and_score_completions`, and with `log_completions=True`
  write the latest batch to `<output_dir>/completions/completions_<step>.parquet` at each log (and print it
  with rich). A batch that falls between two logs is never written. Here the trainer's
  `_generate_and_score_completions` is wrapped: after each call the batch it just added to `_logs` is
  appended to the file, every batch once, with no `log_completions` needed.
- PPOTrainer (trl.experimental.ppo) builds a table (query, model response, score) in
  `generate_completions`, every `num_total_batches // num_sample_generations` updates when
  `num_sample_generations > 0` and there is an eval set, prints 5 rows, and otherwise only hands it to
  wandb/comet. Here `generate_completions` is wrapped and the table captured as it becomes a DataFrame.
- Other trainers sample nothing during training: `attach` returns None.

Use, in train_run, after the trainer is built (the live file survives a crash; train_run's
snaketrl.train.checkpoints.Attempt cuts it back to the rows its checkpoint had, and marks the log reconciled):
    sampler = training_samples.attach(trainer, checkpoint_dir / "training_samples.jsonl", run["name"])
    ... train ...
    training_samples.finish(checkpoint_dir / "training_samples.jsonl", out_dir / "training_samples.jsonl")
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path


class SampleLog:
    """Appends sample rows (run, step, mode, prompt, completion, reward, rewards, advantage) to a JSON Lines
    file. The first write after (re)starting drops rows of steps at or after the current step: a resumed
    run regenerates those."""

    def __init__(self, path, run: str):
        self.path, self.run = Path(path), run
        self.reconciled = False
        self.count = 0

    def write(self, step: int, rows: list[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.reconciled:
            kept = []
            if self.path.is_file():
                kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                        if line.strip() and json.loads(line)["step"] < step]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            self.reconciled = True
        with open(self.path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"run": self.run, "step": step, **row}, ensure_ascii=False, default=_plain) + "\n")
        self.count += len(rows)


def _plain(value):
    return value.item() if hasattr(value, "item") else str(value)


def _num(value):
    value = float(value)
    return None if math.isnan(value) else value


def attach(trainer, path, run: str = "?") -> SampleLog | None:
    """Hook a built trainer so its training-time samples go to `path`; None if it samples nothing."""
    if hasattr(trainer, "_logs") and hasattr(trainer, "_generate_and_score_completions"):
        return _attach_grpo(trainer, SampleLog(path, run))
    ppo = next((c for c in type(trainer).__mro__ if c.__module__.startswith("trl.experimental.ppo")), None)
    if ppo is not None and hasattr(trainer, "generate_completions"):
        return _attach_ppo(trainer, SampleLog(path, run), ppo.__module__)
    return None


def _attach_grpo(trainer, log: SampleLog) -> SampleLog:
    original = trainer._generate_and_score_completions

    def wrapped(inputs, *args, **kwargs):
        mode = "train" if trainer.model.training else "eval"
        step = trainer.state.global_step  # samples generated after this many optimizer updates
        out = original(inputs, *args, **kwargs)
        if trainer.accelerator.is_main_process:
            logs = trainer._logs
            n = min(len(inputs) * trainer.accelerator.num_processes, len(logs["completion"]))
            tail = lambda d: list(d)[-n:]  # noqa: E731 - the batch just added
            prompts, completions = tail(logs["prompt"]), tail(logs["completion"])
            rewards = {name: tail(values) for name, values in logs["rewards"].items()}
            advantages = tail(logs["advantages"])
            weights = [float(w) for w in trainer.reward_weights.tolist()]
            names = list(trainer.reward_func_names)
            rows = []
            for i in range(n):
                per = {name: _num(rewards[name][i]) for name in names if name in rewards}
                total = [w * per[name] for w, name in zip(weights, names) if per.get(name) is not None]
                rows.append({"mode": mode, "prompt": prompts[i], "completion": completions[i],
                             "reward": sum(total) if total else None, "rewards": per,
                             "advantage": _num(advantages[i]) if i < len(advantages) else None})
            log.write(step, rows)
        return out

    trainer._generate_and_score_completions = wrapped
    return log


class _CapturingPandas:
    """Stands in for `pd` inside trl's ppo module while generate_completions runs: the table it turns into
    a DataFrame is kept."""

    def __init__(self, pd):
        self._pd, self.tables = pd, []

    def DataFrame(self, data=None, *args, **kwargs):  # noqa: N802 - pandas' name
        self.tables.append({k: list(v) for k, v in dict(data or {}).items()})
        return self._pd.DataFrame(data, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._pd, name)


def _attach_ppo(trainer, log: SampleLog, module_name: str) -> SampleLog:
    import importlib

    module = importlib.import_module(module_name)
    original = trainer.generate_completions
    pad = trainer.processing_class.pad_token or ""

    def wrapped(*args, **kwargs):
        capture = _CapturingPandas(module.pd)
        module.pd = capture
        try:
            result = original(*args, **kwargs)
        finally:
            module.pd = capture._pd
        if trainer.accelerator.is_main_process:
            for table in capture.tables:
                rows = [{"mode": "sample", "prompt": q, "completion": _strip_pad(r, pad), "reward": _num(s)}
                        for q, r, s in zip(table.get("query", []), table.get("model response", []),
                                           table.get("score", []))]
                log.write(trainer.state.global_step, rows)
        return result

    trainer.generate_completions = wrapped
    return log


def _strip_pad(text: str, pad: str) -> str:
    while pad and text.endswith(pad):
        text = text[: -len(pad)]
    return text


def finish(live_path, out_path) -> int:
    """The run's training_samples.jsonl, written whole (empty for a trainer that samples nothing)."""
    from snaketrl.io import atomic

    live_path = Path(live_path)
    with atomic(out_path) as tmp:
        if live_path.is_file():
            shutil.copyfile(live_path, tmp)
        else:
            Path(tmp).write_text("", encoding="utf-8")
    return sum(1 for line in Path(out_path).read_text(encoding="utf-8").splitlines() if line.strip())
