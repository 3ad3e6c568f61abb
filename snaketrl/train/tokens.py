"""Token efficiency measured during training: real (non-pad) tokens against the tokens the model processed."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from snaketrl.train.cost import (MEMORY_KEYS, FlopMeter, cost_summary, decoder, models_of, peak_memory,
                                 resident_bytes, step_flops)


class TokenCounter(TrainerCallback):
    """Counts, for every optimizer step, the tokens of the model's gradient-enabled forward passes: the real
    ones (the batch's attention mask, or without one the non-pad tokens: transformers' own
    `include_num_input_tokens_seen="non_padding"` rule) and all those the model embeds (batch x padded
    length, a padding-free batch's packed length, or the row groups snaketrl.train.batching runs instead of the
    batch). Reference-model, generation and evaluation passes run without gradients and are not counted there.
    Each step also records its FLOPs (snaketrl.train.cost: trained passes, and the forward-only ones of
    generation, reference, reward and value models; not evaluation's) and the peak memory so far."""

    def __init__(self, pad_token_id: int | None):
        self.pad_token_id = pad_token_id
        # per optimizer step: real, processed, seconds, flops_trained, flops_forward_only, forward_only_tokens,
        # and snaketrl.train.cost.MEMORY_KEYS
        self.steps: list[dict] = []
        self._real = self._processed = 0
        self._started = None
        self._hooks = []
        self.flops = FlopMeter()
        self._models = {}
        self._begin = {}

    def watch(self, trainer) -> None:
        """Count the FLOPs of every model `trainer` runs (the callback itself only gets the trained one)."""
        self._models = models_of(trainer)

    def _count_real(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        real = mask.sum() if mask is not None and mask.dim() == 2 else (ids != self.pad_token_id).sum()
        # Kept on the device until the step ends: int() here would wait for the GPU on every forward.
        self._real = self._real + real.detach()

    def _count_processed(self, module, args):
        if torch.is_grad_enabled():
            self._processed += args[0].numel()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # prepend: before any hook that reshapes the batch (snaketrl.train.attention.unpad), it sees the padded one
        self._hooks = [decoder(model).register_forward_pre_hook(self._count_real, with_kwargs=True, prepend=True),
                       _embeddings(model).register_forward_pre_hook(self._count_processed),
                       *self.flops.hook(self._models or {"policy": getattr(model, "policy", model)})]
        self._started = time.perf_counter()
        # the weights loaded, no step run yet
        self._begin = {"train_begin_rss_bytes": resident_bytes(),
                       **{f"train_begin_{k}": v for k, v in peak_memory().items()}}

    def on_step_begin(self, args, state, control, **kwargs):
        _synchronize()
        self._started = time.perf_counter()
        self.flops.reset()  # evaluation and logging since the last step are no training cost

    def on_step_end(self, args, state, control, **kwargs):
        # A loop without on_step_begin (PPO's) times each step from the end of the one before. The GPU's queued
        # work belongs to the step: without waiting for it, the clock reads when the kernels were launched.
        _synchronize()
        now = time.perf_counter()
        self.steps.append({"step": state.global_step, "real": int(self._real), "processed": self._processed,
                           "seconds": now - self._started, **self.flops.take(), **peak_memory(),
                           **self._begin})
        self._real = self._processed = 0
        self._started = now

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def summary(self, steps: list[dict] | None = None) -> dict:
        """token_efficiency (real / processed) and real tokens per second of training steps (evaluation,
        logging and checkpoints excluded), over every step counted; their FLOPs, seconds and peak memory
        (snaketrl.train.cost.cost_summary) and the weights the FLOPs were counted with. `steps`: the records
        to sum instead of this process's own (every process's, combine_ranks)."""
        steps = self.steps if steps is None else steps
        real = sum(s["real"] for s in steps)
        processed = sum(s["processed"] for s in steps)
        seconds = sum(s["seconds"] for s in steps)
        # The first step also pays one-off costs (cuDNN's autotuning, flex_attention's compilation): the rate
        # without it is what a long run settles at.
        warm_seconds = sum(s["seconds"] for s in steps[1:])
        return {"real_tokens": real, "processed_tokens": processed,
                "token_efficiency": real / processed if processed else None,
                "real_tokens_per_second": real / seconds if seconds else None,
                "warm_real_tokens_per_second": (sum(s["real"] for s in steps[1:]) / warm_seconds
                                                if warm_seconds else None),
                **cost_summary(steps), "flop_weights": self.flops.weights}


class TokenBudget(TrainerCallback):
    """A run's max_tokens, kept: training stops at the first optimizer step by which the real tokens trained
    (TokenCounter's, over every step so far: a resumed run's earlier attempts too, and every process's) reach
    the budget. max_steps, estimated from the length stage's mean_tokens (snaketrl.train.args.steps_for_tokens),
    stays the schedule's length and the bound: batches longer than the mean (the grouped sampler's first one
    holds the longest examples) reach the budget in fewer steps, and without this a run of a few steps
    trained twice its budget on long data."""

    def __init__(self, counter: TokenCounter, limit: float, reduce=None):
        self.counter, self.limit = counter, limit
        self.reduce = reduce  # sums a count over the processes training together (every one stops at once)
        self.reached_at: int | None = None

    @staticmethod
    def count(step: dict) -> int:
        return step["real"]

    def on_step_end(self, args, state, control, **kwargs):
        total = sum(self.count(step) for step in self.counter.steps)
        if self.reduce is not None:
            total = int(self.reduce(total))
        if total >= self.limit:
            self.reached_at = state.global_step
            control.should_training_stop = True
            # No checkpoint of the last step: a run killed before its outputs were written resumes from the one
            # before and stops here again (resumed from this one, transformers would train one more step first).
            control.should_save = False


class FlopBudget(TokenBudget):
    """A run's max_flops: training stops at the first optimizer step by which the FLOPs counted so far
    (snaketrl.train.cost: trained passes, generation, reference, reward and value models; every attempt's
    and every process's, as the report adds them) reach the budget. The schedule (max_steps, or the epochs)
    stays the bound."""

    count = staticmethod(step_flops)


# Per-step records of processes that trained together: counts and FLOPs add up, a step lasts as long as its
# slowest process, and peak memory is the largest process's.
LONGEST = ("seconds", *MEMORY_KEYS)


def combine_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """The job's per-step records from each process's (snaketrl.train.run.gather_steps)."""
    combined = []
    for records in zip(*per_rank):
        step = {"step": records[0]["step"]}
        for key in records[0]:
            if key != "step":
                values = [r[key] for r in records if key in r]
                step[key] = max(values) if key in LONGEST else sum(values)
        combined.append(step)
    return combined


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _embeddings(model):
    """The input embeddings of the model being trained (PPO's trainer holds the policy beside its value model)."""
    return getattr(model, "policy", model).get_input_embeddings()
