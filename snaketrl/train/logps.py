"""GRPO's and RLOO's per-token log-probs of the completion tokens, their logits bounded in chunks.

TRL's `_get_per_token_logps_and_entropies` projects every completion position of the batch onto the vocabulary
at once (transformers' logits_to_keep spares the prompt), divides the logits by the temperature (a copy), and
keeps that copy for the backward pass, whose gradients are as large again: at Gemma 3's 262,144 entries, 16
completions of 32 tokens hold 0.55 GB per copy in fp32. Here the model's forward stops before its output
projection, and the projection, TRL's log-softmax (`selective_log_softmax`) and logged entropy run on at most
CHUNK_BYTES of logits at a time. Where a call's completion logits are more than KEPT_LOGITS_BYTES in all, the training forward
recomputes each chunk's logits in the backward pass (activation checkpointing of the chunk), one more projection of
the completion tokens; below it each chunk keeps its logits for the backward pass instead. A call whose logits fit
in one chunk keeps TRL's own path unchanged, as does one with images, a mixture of experts' auxiliary loss, a
differentiable entropy bonus, or a model whose forward changes its logits after the projection (softcapping,
a logit scale) or that takes no logits_to_keep.

bench/vocab_memory.py (a 262,144-entry vocabulary on a 64-wide model, 2 CPU cores): a GRPO step of 8 prompts x 64
completion tokens added 1.56 GiB to the process's resident memory with TRL's path, 0.40 GiB chunked; 4 x 32,
0.70 and 0.33 GiB (RLOO the same).
"""

from __future__ import annotations

import contextlib
import types

from snaketrl.train.head import one_weight_forward, vocabulary

# The trainers whose completion log-probs this module computes.
TRAINERS = ("grpo", "rloo")

# Logits of one chunk at most: above it a call is chunked. 64 MiB: 64 positions of fp32 logits at 262,144 entries
# (a chunk's backward holds about four such tensors at once).
CHUNK_BYTES = 64 * 2 ** 20


# And 64 positions at most: at SmolLM2's 49,152 entries a chunk's fp32 logits are then 12 MiB, not 64. A job that
# gives its freed memory back (snaketrl.processes) maps every block above 32 MiB afresh and a chunk's temporaries
# then fault in new pages each time: a GRPO trained pass of 16 x 64 completion tokens faulted 550k pages (2.2 GB) at
# 64 MiB chunks, 5k at 12 MiB (heap blocks reused), 10.1-10.9 against 9.7 CPU-s (docs/benchmarks.md).
MAX_CHUNK_POSITIONS = 64

# A call's completion logits kept for the backward pass, all chunks together, at most: above it each chunk's logits
# are recomputed there. A chunk keeps its fp32 logits (what the log-softmax's backward reads), so a GRPO batch of
# 16 x 64 completion tokens at SmolLM2's 49,152 entries keeps 192 MiB and skips a second projection of its 1,024
# positions onto the vocabulary (0.4-0.5 CPU-s of a ~9 CPU-s trained pass on one EPYC thread: docs/benchmarks.md).
# Gemma 3's 262,144 entries reach it at 256 positions: larger batches recompute. The memory estimate
# (snaketrl.train.memory: `kept`) counts what each way keeps.
KEPT_LOGITS_BYTES = 256 * 2 ** 20


def chunk_positions(vocab: int, itemsize: int) -> int:
    """Positions per chunk: CHUNK_BYTES of logits, MAX_CHUNK_POSITIONS at most."""
    return max(1, min(MAX_CHUNK_POSITIONS, CHUNK_BYTES // (vocab * itemsize)))


def exceeds_chunk(positions: int, vocab: int) -> bool:
    """Whether `positions`' fp32 logits over `vocab` entries are more than one chunk (below it TRL's path stays)."""
    return positions * vocab * 4 > CHUNK_BYTES


def keeps_too_much(positions: int, vocab: int) -> bool:
    """Whether `positions`' fp32 logits over `vocab` entries are more than KEPT_LOGITS_BYTES (then recomputed)."""
    return positions * vocab * 4 > KEPT_LOGITS_BYTES


def over_chunks(step, hidden, targets, positions: int, recompute: bool = True) -> list:
    """`step(h, t)` on `positions` rows of `hidden` (N x hidden size) and `targets` (N) at a time, in order: each
    chunk's outputs. Under autograd with `recompute` each chunk keeps only its hidden states and `step` runs again in
    the backward pass; without, each chunk keeps what its backward reads."""
    import torch
    from torch.utils.checkpoint import checkpoint

    parts = []
    for start in range(0, hidden.shape[0], positions):
        h, t = hidden[start:start + positions], targets[start:start + positions]
        grad = recompute and torch.is_grad_enabled() and h.requires_grad
        parts.append(checkpoint(step, h, t, use_reentrant=False) if grad else step(h, t))
    return parts


def chunked_logps(hidden, project, targets, temperature: float, entropy: bool, positions: int, autocast,
                  recompute: bool = True):
    """TRL's per-token log-probs of `targets` (rows x K) and, with `entropy`, their entropies (without gradient),
    from the hidden states (rows x K x hidden) that score them: `project` (the output projection, run under
    `autocast` as in the model's forward) and TRL's log-softmax run on `positions` of them at a time, on logits of
    the hidden states' dtype (the model's output dtype: accelerate's mixed precision returns fp32). Under autograd
    each chunk keeps only its hidden states; its logits are computed again in the backward pass."""
    import torch
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    rows, keep = targets.shape
    flat, ids = hidden.reshape(rows * keep, hidden.shape[-1]), targets.reshape(-1)

    def chunk(h, t):
        with autocast:
            logits = project(h)
        logits = logits.to(hidden.dtype) / temperature
        logp = selective_log_softmax(logits, t)
        with torch.no_grad():  # after the log-probs: the backward pass's recomputation stops before it
            spread = entropy_from_logits(logits) if entropy else None
        return logp, spread

    parts = over_chunks(chunk, flat, ids, positions, recompute)
    logps = torch.cat([p[0] for p in parts]).view(rows, keep)
    return logps, torch.cat([p[1] for p in parts]).view(rows, keep) if entropy else None


@contextlib.contextmanager
def without_projection(head):
    """`head` (the output projection) passes its input through: the model's forward returns hidden states as its
    logits. Its forward hooks still run once, on the positions it would project (snaketrl.train.cost counts the
    projection's tokens there). Yields the autocast the projection would have run under (accelerate's mixed
    precision turns it on inside the model's forward)."""
    import torch

    own, seen = head.__dict__.get("forward"), []

    def passed(hidden):
        kind = hidden.device.type
        seen.append(torch.autocast(kind, dtype=torch.get_autocast_dtype(kind),
                                   enabled=torch.is_autocast_enabled(kind)))
        return hidden

    head.forward = passed
    try:
        yield seen
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def supported(model) -> bool:
    """Whether the model's logits are its output projection of the last positions and nothing more (unwrapped:
    a peft model or a bare one)."""
    from snaketrl.train.labelled import takes_logits_to_keep

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (inner.get_output_embeddings() is not None and takes_logits_to_keep(model)
            and projection_alone(inner.config.to_dict()))


def projection_alone(config: dict) -> bool:
    """Whether a model's config (config.json's fields) changes no logit after the output projection: no softcapping,
    no logit scale."""
    text = config.get("text_config") or config
    return text.get("final_logit_softcapping") is None and text.get("logit_scale") in (None, 1.0)


def chunk_completion_logits(trainer) -> None:
    """`trainer` (TRL's GRPO or RLOO, its weights whole in each process: not under FSDP or ZeRO-3, whose hooks
    gather them) computes its per-token log-probs as the module docstring says."""
    import torch

    trl_logps = trainer._get_per_token_logps_and_entropies
    fits: dict = {}

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                            compute_entropy=False, compute_aux_loss=False, **images):
        inner = self.accelerator.unwrap_model(model)
        if id(inner) not in fits:
            fits[id(inner)] = supported(inner)
        head = inner.get_output_embeddings() if fits[id(inner)] else None
        vocab = vocabulary(head) if head is not None else 0
        batch_size = min(batch_size or input_ids.size(0), input_ids.size(0))
        if (head is None or compute_aux_loss or any(v is not None for v in images.values())
                or (compute_entropy and getattr(self, "_entropy_bonus_enabled", False))
                or not exceeds_chunk(batch_size * (logits_to_keep + 1), vocab)):
            return trl_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                             compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **images)
        positions = chunk_positions(vocab, 4)  # fp32 logits at most
        recompute = keeps_too_much(input_ids.size(0) * logits_to_keep, vocab)
        project = one_weight_forward(head)  # a head that trains rows: its weight built once for every chunk
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            with without_projection(head) as autocast:
                # TRL asks for one more position, as here: the last one's logits look past the completion
                hidden = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep + 1,
                               use_cache=False).logits
            # the projection's own forward: its hooks ran above, once for the whole batch
            logps, entropies = chunked_logps(hidden[:, :-1][:, -logits_to_keep:], project,
                                             ids[:, -logits_to_keep:], self.temperature, compute_entropy, positions,
                                             autocast[0], recompute)
            all_logps.append(logps)
            all_entropies.append(entropies)
        return torch.cat(all_logps), torch.cat(all_entropies) if compute_entropy else None, None

    trainer._get_per_token_logps_and_entropies = types.MethodType(logps_and_entropies, trainer)
