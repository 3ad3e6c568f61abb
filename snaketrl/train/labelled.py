"""SFT's loss on the label tokens only, in one pass: TRL's `loss_type: chunked_nll` without its recomputation.

TRL's chunked_nll runs the vocabulary projection only where labels are not -100 (a prompt's tokens, padding),
in chunks, each recomputed in the backward pass (gradient checkpointing) so that a GPU never holds a whole
batch's logits. On a CPU memory is not what is short, and the recomputation costs what skipping the prompt
saves. Here the label tokens' logits are computed once, as one chunk, for the same loss, token accuracy and
entropy TRL logs. It also spares what TRL's default loss does at every position of a batch: the vocabulary
projection, and the entropy and argmax over the vocabulary for its logged metrics.

bench/gpu.py on SmolLM2-135M-Instruct (SFT on LIMA, 20.5 % of the tokens prompt, 6 steps, 2-core AMD EPYC):
93 real tokens/s before, 109 after (TRL's chunked_nll: 95), with the same train and eval losses.

DPO's logits and loss likewise, from each row's first completion token on (`completion_logits`)."""

from __future__ import annotations

import inspect
import types

REASON = ("the vocabulary projection, loss and logged entropy only on label tokens, in one pass (TRL's "
          "chunked_nll without its recomputation; 1.17x real tokens/s for SmolLM2 SFT on a CPU)")


DPO_REASON = ("the vocabulary projection of policy and reference, and TRL's loss, only from each row's first "
              "completion token on: TRL's DPO scores completion tokens only")
TAILS = "snaketrl_tail_starts"  # per row, where its logits start: the position before its first completion token
WHOLE = "snaketrl_input_ids"  # the rows' whole input_ids, while TRL's loss gets their tails


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
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels).sum().float()
    del logits  # log_softmax keeps its output, not its input: the label tokens' logits go here
    loss = F.nll_loss(log_p, labels, reduction="sum")
    with torch.no_grad():
        entropy = -log_p.exp().mul_(log_p).sum()  # in place: one vocabulary-sized copy fewer
    count = valid.sum()
    if num_items_in_batch is None:
        return loss / count.clamp(min=1), correct, entropy, count
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch, correct, entropy, count


def choose(trainer: str, args: dict, device: str, model, lora: dict, tiny: bool = False) -> tuple[bool, str | None]:
    """Whether a run computes logits on label tokens only, and why (None: nothing to say), on a CPU for a real
    model: SFT in one pass (`use_one_pass`), unless the config sets loss_type or an adapter wraps the output
    projection (TRL's chunked_nll reads its weight directly); DPO from each row's first completion token on
    (`completion_logits`), where the model's forward applies an output projection of its own to the positions it is
    asked for (transformers' logits_to_keep). A tiny model keeps TRL's loss: its learning checks and thresholds
    were measured with it."""
    if trainer not in ("sft", "dpo") or device != "cpu" or tiny:
        return False, None
    if trainer == "dpo":
        if model.get_output_embeddings() is None or not takes_logits_to_keep(model):
            return False, ("TRL's logits at every position: the model's forward applies no output projection of its "
                           "own to some positions (transformers' logits_to_keep)")
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
    if lora.get("trainable_token_indices"):  # rows of the embeddings, and of a tied or untied head, trained
        return False, f"TRL's loss on all positions: rows of the output projection {head} train (added tokens)"
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


def completion_logits(trainer, row_groups: bool = False) -> None:
    """TRL's DPO projects every position of the chosen and rejected rows onto the vocabulary, for the policy (and
    back again in the backward pass) and for the reference, runs its loss and logged metrics (log-softmax, entropy,
    argmax) over all of them, and then keeps the completion tokens alone: an HH transcript's earlier turns are most
    of its tokens. Here TRL's loss gets each row's tail instead, from the position before its first completion
    token on, all tails as wide as the longest (`completion_tails`), and the model's forward projects only those
    positions' hidden states: every value TRL reads is the same, at a fraction of the rows x tokens x vocabulary
    work. The forward still runs the whole rows, which reach it under a key of their own; with `row_groups` it
    runs them in row groups (snaketrl.train.batching.split_rows), each group projecting its rows' tails. A call
    that returns the outputs (an evaluation with compute_metrics) gets TRL's logits at every position."""
    from snaketrl.train.batching import split_rows

    compute = trainer._compute_loss

    def loss_on_tails(model, inputs, return_outputs):
        tails = None if return_outputs else completion_tails(inputs)
        return compute(model, {**inputs, **tails} if tails else inputs, return_outputs)

    trainer._compute_loss = loss_on_tails
    for model in (trainer.model, getattr(trainer, "ref_model", None)):  # TRL passes the reference the same inputs
        if model is not None:
            project_tails(model)
            if row_groups:
                split_rows(model, trainer.args.pad_to_multiple_of)
            _whole_rows(model)


def completion_tails(inputs: dict) -> dict | None:
    """What TRL's DPO loss gets instead of a batch's rows: each row's tokens and completion mask from the position
    before its first completion token on (the logit there scores that token), the same width for every row (the
    longest tail's; past its row's end a tail is masked), with the whole rows (WHOLE) and the tails' starts (TAILS)
    for the forward. None where it would not pay (no row's tail shorter than the batch) or could mislead: a batch
    with other per-position inputs (position or token type ids, images), which would need their tails too."""
    import torch

    ids, completion = inputs["input_ids"], inputs["completion_mask"]
    if any(torch.is_tensor(value) and value.dim() >= 2 and key not in ("input_ids", "attention_mask", "completion_mask")
           for key, value in inputs.items()):
        return None
    width = ids.shape[1]
    scored = completion.bool()
    some = scored.any(dim=1)  # a row without completion tokens contributes nothing: a tail of one masked position
    first = torch.where(some, scored.int().argmax(dim=1), 0)
    end = torch.where(some, width - scored.flip(1).int().argmax(dim=1), 1)
    starts = (first - 1).clamp(min=0)  # a completion token at position 0 has no logit: TRL's shift drops it too
    keep = int((end - starts).max())
    if keep >= width:
        return None
    positions = starts[:, None] + torch.arange(keep, device=ids.device)
    inside = positions < width
    positions = positions.clamp(max=width - 1)
    return {"input_ids": ids.gather(1, positions), "completion_mask": completion.gather(1, positions) * inside,
            WHOLE: ids, TAILS: starts}


def project_tails(model) -> None:
    """`model`'s forward, given TAILS and the tails' width (snaketrl.train.batching.OUTPUT_WIDTH), runs its rows
    whole and applies its vocabulary projection to the hidden states of the tails alone: the logits are rows x
    width x vocabulary, position j of a row's the logit at its start + j."""
    import torch

    from snaketrl.train.batching import OUTPUT_WIDTH

    forward, tails = model.forward, []

    def tails_forward(self, *args, **kwargs):
        starts, width = kwargs.pop(TAILS, None), kwargs.pop(OUTPUT_WIDTH, None)
        if starts is None:
            return forward(*args, **kwargs)
        tails.append((starts, width))
        try:
            return forward(*args, **kwargs)
        finally:
            tails.pop()

    def gather_tails(module, args):
        if not tails:
            return None
        hidden, (starts, width) = args[0], tails[-1]
        positions = (starts[:, None] + torch.arange(width, device=starts.device)).clamp(max=hidden.shape[1] - 1)
        return (hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1])), *args[1:])

    model.forward = types.MethodType(tails_forward, model)
    # first: hooks after it (the FLOPs counter's) see the positions that are projected
    model.get_output_embeddings().register_forward_pre_hook(gather_tails, prepend=True)


def _whole_rows(model) -> None:
    """`model`'s forward, given the tails as input_ids and the whole rows under WHOLE, runs the whole rows and
    asks for logits as wide as the tails."""
    from snaketrl.train.batching import OUTPUT_WIDTH

    forward = model.forward

    def whole_forward(self, *args, **kwargs):
        whole = kwargs.pop(WHOLE, None)
        if whole is not None:
            kwargs[OUTPUT_WIDTH], kwargs["input_ids"] = kwargs["input_ids"].shape[1], whole
        return forward(*args, **kwargs)

    model.forward = types.MethodType(whole_forward, model)
