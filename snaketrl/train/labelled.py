"""SFT's loss on the label tokens only, in one pass: TRL's `loss_type: chunked_nll` without its recomputation.

TRL's chunked_nll runs the vocabulary projection only where labels are not -100 (a prompt's tokens, padding),
in chunks, each recomputed in the backward pass (gradient checkpointing) so that a GPU never holds a whole
batch's logits. On a CPU memory is not what is short, and the recomputation costs what skipping the prompt
saves. Here the label tokens' logits are computed once, as one chunk, for the same loss, token accuracy and
entropy TRL logs. It also spares what TRL's default loss does at every position of a batch: the vocabulary
projection, and the entropy and argmax over the vocabulary for its logged metrics.

bench/gpu.py on SmolLM2-135M-Instruct (SFT on LIMA, 20.5 % of the tokens prompt, 6 steps, 2-core AMD EPYC):
93 real tokens/s before, 109 after (TRL's chunked_nll: 95), with the same train and eval losses.

DPO's logits likewise, from each batch's first completion token on (`completion_logits`)."""

from __future__ import annotations

import inspect
import types

REASON = ("the vocabulary projection, loss and logged entropy only on label tokens, in one pass (TRL's "
          "chunked_nll without its recomputation; 1.17x real tokens/s for SmolLM2 SFT on a CPU)")


DPO_REASON = ("the vocabulary projection of policy and reference from each batch's first completion token on: TRL's "
              "DPO scores completion tokens only")
COMPLETION = "snaketrl_completion_mask"  # the completion mask, on its way from the loss to the model's forward


def one_pass_loss(hidden_states, lm_head_weight, chunk_size, labels=None, shift_labels=None,
                  num_items_in_batch=None, logit_scale=1.0, final_logit_softcapping=None, lm_head_bias=None):
    """trl.trainer.sft_trainer._chunked_cross_entropy_loss's result (loss, correct tokens, entropy sum, label
    tokens), its logits computed once for all label tokens."""
    import torch
    import torch.nn.functional as F

    if shift_labels is not None:
        hidden, labels = hidden_states.reshape(-1, hidden_states.size(-1)), shift_labels.reshape(-1)
    else:
        hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
        labels = labels[..., 1:].reshape(-1)
    valid = labels != -100
    hidden, labels = hidden[valid], labels[valid]
    logits = hidden.float() @ lm_head_weight.float().t()
    if lm_head_bias is not None:
        logits = logits + lm_head_bias.float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if final_logit_softcapping is not None:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    log_p = F.log_softmax(logits, dim=-1)
    loss = F.nll_loss(log_p, labels, reduction="sum")
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels).sum().float()
        entropy = -(log_p.exp() * log_p).sum()
    count = valid.sum()
    if num_items_in_batch is None:
        return loss / count.clamp(min=1), correct, entropy, count
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch, correct, entropy, count


def choose(trainer: str, args: dict, device: str, model, lora: dict, tiny: bool = False) -> tuple[bool, str | None]:
    """Whether a run computes logits on label tokens only, and why (None: nothing to say), on a CPU for a real
    model: SFT in one pass (`use_one_pass`), unless the config sets loss_type or an adapter wraps the output
    projection (TRL's chunked_nll reads its weight directly); DPO from the first completion token on
    (`completion_logits`), where the model's forward takes transformers' logits_to_keep. A tiny model keeps TRL's
    loss: its learning checks and thresholds were measured with it."""
    if trainer not in ("sft", "dpo") or device != "cpu" or tiny:
        return False, None
    if trainer == "dpo":
        if not takes_logits_to_keep(model):
            return False, "TRL's logits at every position: the model's forward takes no logits_to_keep"
        return True, DPO_REASON
    if "loss_type" in args:
        return False, f"loss_type {args['loss_type']} (the config's)"
    output = model.get_output_embeddings()
    head = next((name for name, module in model.named_modules() if output is not None and module is output), None)
    if head is None:
        return False, "TRL's loss: the model has no output projection of its own to skip positions of"
    targets = lora.get("target_modules") or []
    adapted = {targets} if isinstance(targets, str) else set(targets)  # "all-linear" leaves the output projection out
    adapted |= set(lora.get("modules_to_save") or [])
    if head.rsplit(".", 1)[-1] in adapted:
        return False, f"TRL's loss on all positions: the output projection {head} is adapted (lora)"
    return True, REASON


def trl_loss():
    """TRL's own chunked loss function, whether or not use_one_pass replaced it."""
    import trl.trainer.sft_trainer as sft

    return _replaced[0] if _replaced else sft._chunked_cross_entropy_loss


_replaced: list = []


def use_one_pass() -> None:
    """TRL's chunked_nll forward (patched into the model when the trainer is built) computes its loss in one pass,
    in this process from now on: TRL looks its loss function up by name at every forward."""
    import trl.trainer.sft_trainer as sft

    if not _replaced:
        _replaced.append(sft._chunked_cross_entropy_loss)
        sft._chunked_cross_entropy_loss = one_pass_loss


def takes_logits_to_keep(model) -> bool:
    """Whether the model's forward (under a peft wrapper: its base model's) computes logits only for its last
    positions when asked (transformers' `logits_to_keep`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def completion_logits(trainer) -> None:
    """TRL's DPO projects every position of the chosen and rejected rows onto the vocabulary, for the policy (and
    back again in the backward pass) and for the reference, and then scores the completion tokens alone: an HH
    transcript's earlier turns are most of its tokens. Here the model's forward computes logits only from the
    position before a batch's (a row group's) first completion token on (transformers' `logits_to_keep`), and
    zeros before them, which TRL masks: the same loss and logged metrics. The completion mask travels to the forward
    as one more input (per row, so row groups split it too), which the forward takes off before the model sees it.
    Call before the row groups are set up (snaketrl.train.run.split_model_rows), which then wrap this forward."""
    import torch

    class LeftPadded(torch.autograd.Function):
        """Logits of a sequence's last positions, zeros before them, to `width` positions: F.pad would fill the
        whole rows x width x vocabulary tensor and then copy the kept logits over the zeros."""

        @staticmethod
        def forward(ctx, kept, width):
            out = kept.new_empty((kept.shape[0], width, *kept.shape[2:]))
            out[:, :width - kept.shape[1]].zero_()
            out[:, width - kept.shape[1]:].copy_(kept)
            ctx.keep = kept.shape[1]
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad[:, -ctx.keep:], None

    compute, model = trainer._compute_loss, trainer.model
    forward = model.forward

    def with_completion(model, inputs, return_outputs):
        return compute(model, {**inputs, COMPLETION: inputs["completion_mask"]}, return_outputs)

    def keep_completion(self, *args, **kwargs):
        completion = kwargs.pop(COMPLETION, None)
        if completion is None or args or kwargs.get("logits_to_keep"):
            return forward(*args, **kwargs)
        width = completion.shape[1]
        starts = torch.where(completion.bool().any(dim=1), completion.int().argmax(dim=1), width)
        keep = width - max(int(starts.min()), 1) + 1  # the logit at position j scores token j+1
        if keep >= width:
            return forward(**kwargs)
        output = forward(**kwargs, logits_to_keep=keep)
        output["logits"] = LeftPadded.apply(output.logits, width)
        return output

    trainer._compute_loss = with_completion
    model.forward = types.MethodType(keep_completion, model)
    # transformers slices the hidden states it projects (hidden_states[:, -keep:]): across rows that view is not
    # contiguous, and torch then runs the vocabulary projection as a bmm over the weight broadcast to every row
    # instead of the one mm of TRL's full-width forward.
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
