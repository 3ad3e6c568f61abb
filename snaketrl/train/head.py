"""The output head: it reads its input contiguous, and a head that trains added token rows builds its weight once a
pass.

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

A head whose rows a chat template added train (peft's TrainableTokensWrapper: trainable_token_indices) builds its
whole weight, vocabulary x hidden, at each call of its forward: at Gemma 3's 262,146 x 640 in bf16, 0.19 CPU-s a
copy. The trained passes that project a chunk of positions at a time (snaketrl.train.logps, snaketrl.train.ppo)
would build it once per chunk, and once more per chunk their backward pass recomputes; `one_weight_forward` builds it
once per pass, and every chunk reads that tensor: the same values, the chunks' gradients summed into it and passed to
the trained rows once.
"""

from __future__ import annotations

import contextlib


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


def vocabulary(head) -> int:
    """Entries of the output projection `head`: its base layer's rows (a peft wrapper's `weight` would build its whole
    merged weight to answer)."""
    base = getattr(head, "original_module", None)
    return (head if base is None else base).weight.shape[0]


def one_weight_forward(head):
    """`head`'s forward for the chunks of one pass: a head that trains added token rows (peft's trainable tokens,
    active and unmerged) gets its weight built here, once, and each call reads it; any other head, its own forward.
    Called within the pass (the adapter's state, grad mode as the chunks'); the backward pass's recomputation of a
    chunk reads the same tensor."""
    adapter = getattr(head, "token_adapter", None)
    if adapter is None or adapter.merged or adapter.disable_adapters or not adapter.active_adapters:
        return head.forward
    weight = adapter.get_merged_weights(adapter.active_adapters)

    def forward(hidden):
        with built(adapter, weight):
            return head.forward(hidden)  # peft's own forward (looked up now), on the weight built above

    return forward


@contextlib.contextmanager
def built(adapter, weight):
    """peft's trainable-tokens layer `adapter` takes `weight` as its merged weight within."""
    adapter.get_merged_weights = lambda active_adapters: weight
    try:
        yield
    finally:
        del adapter.get_merged_weights
