"""Token efficiency measured during training: real (non-pad) tokens against the tokens the model processed."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback


class TokenCounter(TrainerCallback):
    """Counts, for every optimizer step, the tokens of the model's gradient-enabled forward passes: the real
    ones (the batch's attention mask, or without one the non-pad tokens: transformers' own
    `include_num_input_tokens_seen="non_padding"` rule) and all those the model embeds (batch x padded
    length, a padding-free batch's packed length, or the row groups snaketrl.train.batching runs instead of the
    batch). Reference-model, generation and evaluation passes run without gradients and are not counted."""

    def __init__(self, pad_token_id: int | None):
        self.pad_token_id = pad_token_id
        self.steps: list[dict] = []  # per optimizer step: real, processed, seconds
        self._real = self._processed = 0
        self._started = None
        self._hooks = []

    def _count_real(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        real = mask.sum() if mask is not None and mask.dim() == 2 else (ids != self.pad_token_id).sum()
        self._real += int(real)

    def _count_processed(self, module, args):
        if torch.is_grad_enabled():
            self._processed += args[0].numel()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._hooks = [_backbone(model).register_forward_pre_hook(self._count_real, with_kwargs=True),
                       _embeddings(model).register_forward_pre_hook(self._count_processed)]
        self._started = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        # A loop without on_step_begin (PPO's) times each step from the end of the one before.
        now = time.perf_counter()
        self.steps.append({"step": state.global_step, "real": self._real, "processed": self._processed,
                           "seconds": now - self._started})
        self._real = self._processed = 0
        self._started = now

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def summary(self) -> dict:
        """token_efficiency (real / processed) and real tokens per second of training steps (evaluation,
        logging and checkpoints excluded), over every step counted."""
        real = sum(s["real"] for s in self.steps)
        processed = sum(s["processed"] for s in self.steps)
        seconds = sum(s["seconds"] for s in self.steps)
        return {"real_tokens": real, "processed_tokens": processed,
                "token_efficiency": real / processed if processed else None,
                "real_tokens_per_second": real / seconds if seconds else None}


def _backbone(model):
    """The decoder stack (transformers' `base_model`: the model without its head) of the model being trained.
    Every training forward runs it with the batch's input_ids and attention_mask: the model's own forward, and the
    fused-loss paths of TRL's Liger DPO/KTO/GRPO, which call it directly and never the model (nor peft's wrapper)."""
    model = getattr(model, "policy", model)
    if hasattr(model, "get_base_model"):  # a peft model: its own `base_model` is the tuner, not the decoder
        model = model.get_base_model()
    return getattr(model, "base_model", model)


def _embeddings(model):
    """The input embeddings of the model being trained (PPO's trainer holds the policy beside its value model)."""
    return getattr(model, "policy", model).get_input_embeddings()
