"""Batches run in two length groups of rows: TRL's collators pad every row of a batch to its longest (a
preference batch's chosen and rejected rows too, and TRL 1.12's DPO ignores padding_free), so a batch of long
chosen and short rejected answers is half padding even when length-grouped."""

from __future__ import annotations

import types

import torch

from snaketrl.data.lengths import row_groups

# Forward arguments whose outputs are not per row (caches, hidden states, router losses): a forward given any
# of them runs as one, as TRL calls it.
WHOLE_BATCH = ("past_key_values", "output_hidden_states", "output_attentions", "output_router_logits")
# Scalar means over a forward's label tokens: Liger's fused linear cross-entropy (TRL's SFTTrainer with
# use_liger_kernel asks for `return_token_accuracy`) returns the batch's token accuracy as one number. The groups'
# values are recombined weighted by each group's label tokens, as the loss is.
LABEL_MEANS = ("token_accuracy",)
# A forward argument fixing the width of the outputs' sequence dimension, whatever a group's width: the groups'
# outputs are then put in row order as they are (snaketrl.train.labelled's DPO tails). The forward below takes it.
OUTPUT_WIDTH = "snaketrl_output_width"


def split_rows(model, pad_to_multiple_of: int | None = None):
    """Make `model`'s forward run a right-padded batch (input_ids, attention_mask) as snaketrl.data.lengths.row_groups
    says: each group trimmed to its longest row (rounded up to `pad_to_multiple_of`) and run on its own, and the
    outputs put back in row order, padded to the batch's length (logits at padding positions are zeros: TRL
    masks them). With `labels`, the loss is the groups' losses recombined as the whole batch's: summed when
    divided by the batch's `num_items_in_batch`, else weighted by each group's label tokens. Exact up to float
    rounding: a row's real tokens see only themselves (causal attention, right padding), and a trimmed column
    is padding in every row of its group. Under sdpa attention a right-padded group runs without its padding
    mask, for the same reason: sdpa then takes torch's causal kernel, which skips the blocks above the diagonal
    that a mask makes it compute (fwd+bwd 36 against 44 ms for two 460-token rows of SmolLM2's attention on a
    2-core AMD EPYC); the outputs at padding positions are then the model's continuation, which nothing reads
    (labels there are -100, TRL's preference losses mask them). Returns `model`."""
    forward = model.forward
    causal = getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"

    def split_forward(self, *args, **kwargs):
        split = _groups(args, kwargs, pad_to_multiple_of, causal)
        if split is None:
            return forward(*args, **kwargs)
        groups, unmasked = split
        rows, length = kwargs["input_ids"].shape
        indices = [torch.tensor(group, device=kwargs["input_ids"].device) for group, _ in groups]
        outputs = []
        for index, (group, width) in zip(indices, groups):
            part = {key: _rows_of(value, index, width, rows, length) for key, value in kwargs.items()}
            if unmasked:
                part["attention_mask"] = None
            outputs.append((len(group), width, forward(**part)))
        merged = {}
        for key in outputs[0][2].keys():
            values = [out[key] for _, _, out in outputs]
            if key == "loss":
                merged[key] = _loss(values, groups, kwargs)
            elif key == "past_key_values":  # a cache of one group's rows serves nothing; generation never splits
                continue
            elif _is_total(key, values[0]):
                merged[key] = sum(values)
            elif key in LABEL_MEANS and torch.is_tensor(values[0]) and values[0].dim() == 0:
                merged[key] = _label_mean(values, groups, kwargs)
            else:
                merged[key] = _in_row_order(values, [group for group, _ in groups], [width for _, width in groups],
                                            None if OUTPUT_WIDTH in kwargs else length, key)
        return type(outputs[0][2])(**merged)

    model.forward = types.MethodType(split_forward, model)
    return model


def _groups(args, kwargs, multiple, causal=False):
    """([(rows, width)], unmasked) for a batch this forward can split, else None (one group and nothing to
    gain, or inputs it cannot split). `causal`: a group may run without its padding mask (`unmasked`), so one
    group with padding is worth running on its own."""
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if args or ids is None or mask is None or ids.dim() != 2 or mask.shape != ids.shape:
        return None
    if any(kwargs.get(key) is not None and kwargs.get(key) is not False for key in WHOLE_BATCH):
        return None
    rows, length = ids.shape
    for value in kwargs.values():  # any other tensor must be per row (labels) or a scalar, else run it whole
        if torch.is_tensor(value) and value.dim() and value.shape[:1] != (rows,):
            return None
    # A row's end: one past its last real token (all of it for rows without padding).
    ends = (mask.bool() * torch.arange(1, length + 1, device=mask.device)).amax(dim=1).tolist()
    groups = row_groups(ends)
    if len(groups) == 1:  # in the batch's own order: its outputs are then the batch's as they are
        groups = [list(range(rows))]
    # Without their padding mask only where every row's padding follows its real tokens: causal attention then
    # keeps it from them.
    unmasked = causal and mask.sum(dim=1).tolist() == ends
    if len(groups) == 1 and not (unmasked and min(ends) < length):
        return None  # one group without padding to leave out: TRL's one forward
    widths = [max(ends[i] for i in group) for group in groups]
    if multiple:
        widths = [min(length, -(-width // multiple) * multiple) for width in widths]
    return list(zip(groups, widths)), unmasked


def _label_counts(groups, kwargs):
    """Each group's label tokens: those a causal LM scores (labels shifted by one, or pre-shifted `shift_labels`)."""
    shifted = kwargs.get("shift_labels")
    valid = shifted != -100 if shifted is not None else kwargs["labels"][:, 1:] != -100
    return [valid[group].sum() for group, _ in groups]


def _label_mean(values, groups, kwargs):
    """A per-label-token mean of the whole batch from its groups' (a group without label tokens has none: 0/0)."""
    counts = _label_counts(groups, kwargs)
    total = sum(counts)
    if not total:
        return values[0]
    return sum(value * count for value, count in zip(values, counts) if count) / total


def _loss(losses, groups, kwargs):
    """The whole batch's causal-LM loss from its groups' (transformers' ForCausalLMLoss: a sum over label
    tokens divided by num_items_in_batch, or without it their mean)."""
    if kwargs.get("num_items_in_batch") is not None:
        return sum(losses)
    return _label_mean(losses, groups, kwargs)


def _is_total(key, value) -> bool:
    """A scalar count or sum over the batch's tokens (TRL's chunked loss: correct tokens, entropy, valid tokens),
    which the groups' values add up to."""
    return torch.is_tensor(value) and value.dim() == 0 and (key.startswith("num_") or key.endswith("_sum"))


def _rows_of(value, index, width, rows, length):
    if not torch.is_tensor(value) or not value.dim():
        return value
    value = value.index_select(0, index)
    return value[:, :width] if value.dim() >= 2 and value.shape[1] == length else value


def _in_row_order(values, groups, widths, length, key):
    """The groups' per-row outputs as one tensor in the batch's row order, padded back to its `length` where they
    have a sequence dimension (zeros past each group's width); as they are without a `length`."""
    for value, group in zip(values, groups):
        if not torch.is_tensor(value) or value.shape[:1] != (len(group),):
            raise RuntimeError(f"snaketrl.train.batching.split_rows: the model's output '{key}' is not per row; "
                               f"set length.batching to padded for this trainer")
    if length is None or not all(value.dim() >= 3 and value.shape[1] == width for value, width in zip(values, widths)):
        widths, length = [None] * len(values), None  # per row, without a sequence dimension to pad
    if len(groups) == 1 and groups[0] == list(range(len(groups[0]))) and widths[0] in (None, length):
        return values[0]  # one group of all rows in their order, nothing to pad
    return _InRowOrder.apply(groups, widths, sum(map(len, groups)), length, *values)


class _InRowOrder(torch.autograd.Function):
    """Each group's rows written once into one tensor, and their gradients read back once. A DPO batch's logits are
    rows x tokens x vocabulary: padding them, concatenating the groups and reordering the rows took a pass over
    them each, and in-place writes into one tensor would make autograd copy its whole gradient per write."""

    @staticmethod
    def forward(ctx, groups, widths, rows, length, *values):
        first = values[0]
        out = first.new_empty((rows, length, *first.shape[2:]) if length else (rows, *first.shape[1:]))
        for value, group, width in zip(values, groups, widths):
            for source, row in enumerate(group):  # row by row: plain copies, not an index_put scatter
                if width is None:
                    out[row].copy_(value[source])
                    continue
                out[row, :width].copy_(value[source])
                out[row, width:].zero_()
        ctx.groups, ctx.widths = groups, widths
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, *[
            (grad if width is None else grad[:, :width]).index_select(0, torch.tensor(group, device=grad.device))
            for group, width in zip(ctx.groups, ctx.widths)])
