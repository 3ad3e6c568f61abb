"""The output head reads its input contiguous.

transformers' causal LMs cut the last hidden states to the positions asked for (`logits_to_keep`: the last one in
generation's prefill, a completion's in TRL's log-probabilities) with a slice, `hidden[:, -k:, :]`, and hand the
view to `lm_head`. torch's matmul folds a 3-D input into one matrix multiply only where its leading dimensions are
contiguous or the weight needs a gradient; for a slice of a longer sequence and a frozen head (as under LoRA) it
broadcasts the head's weight over the batch instead: a copy of batch x vocabulary x hidden values, then a batched
multiply. That happens in generation's prefill and in TRL's log-probabilities, with and without gradients. On
SmolLM2-135M (vocabulary 49,152) in bf16 on one CPU thread, 16 prompts' prefill spent 2.0 s of GRPO's ~11 CPU-s
generation in that copy (0.9 GB), a trained pass's forward on 65 positions 2.6 s, against 12 ms for the prefill's
product folded. A contiguous copy of the kept positions (batch x k x hidden values) makes it one matrix multiply,
with the same values: the same dot products, summed in another blocking (bit-equal on SmolLM2 in bf16, fp32 rounding
apart on the tiny model: tests/test_head.py), so sampling draws the same tokens. Applied to every job's model
(snaketrl.train.run.build_trainer): no device chooses otherwise.
"""

from __future__ import annotations


def contiguous_head(model) -> bool:
    """Give `model`'s output embeddings (its lm_head, under a peft wrapper too) a forward pre-hook that makes their
    input contiguous. Whether it had a head to hook; hooking twice adds no second hook."""
    get = getattr(model, "get_output_embeddings", None)  # PPO's policy-and-value wrapper has none
    head = get() if get is not None else None
    if head is None:
        return False
    if not getattr(head, "snaketrl_contiguous", False):
        head.register_forward_pre_hook(contiguous_input)
        head.snaketrl_contiguous = True
    return True


def contiguous_input(module, args):
    """The head's hidden states contiguous (a no-op where they are), its other arguments as given."""
    hidden, *rest = args
    return (hidden.contiguous(), *rest)
