"""Generation's prefill once per distinct prompt.

GRPO and RLOO generate num_generations completions of each prompt in one batch: TRL repeats every prompt that many
times (16 rows of 4 distinct prompts in config/smollm2.yaml's GRPO), and transformers' prefill runs the model on
every row. Here the prefill runs on the distinct rows (the same token ids and attention mask) only; its logits and
the KV cache it filled are then repeated back to the batch's rows, in the batch's order, before the first token is
drawn. Each row is computed as before, by itself (a row's values do not depend on the other rows of its batch: the
same logits and tokens bit for bit, tests/test_prefill.py), on a quarter of the rows. On SmolLM2-135M (one EPYC
thread, 16 prompts of ~52 tokens, bf16) the prefill took ~1 CPU-s of a ~7 CPU-s generation.

Only where it is plainly the same computation: the first iteration of a plain generation with an empty dynamic
cache (transformers' DynamicCache of full or sliding-window layers: keys and values alone), from token ids, with
no chunked prefill; otherwise transformers' own prefill. Applied by snaketrl.train.run.build_trainer where the plan
says (snaketrl.train.plan.dedupes_prefill).
"""

from __future__ import annotations

import contextlib

from snaketrl.train.generation import around_generation


def distinct_rows(input_ids, attention_mask):
    """The first index of each distinct row (token ids and mask together) in order of first appearance, and each
    row's position among them; None where every row is distinct."""
    import torch

    rows = input_ids if attention_mask is None else torch.cat([input_ids, attention_mask.to(input_ids.dtype)], 1)
    first, seen, inverse = [], {}, []
    for i, row in enumerate(map(tuple, rows.tolist())):
        if row not in seen:
            seen[row] = len(first)
            first.append(i)
        inverse.append(seen[row])
    if len(first) == rows.shape[0]:
        return None
    return torch.tensor(first, device=input_ids.device), torch.tensor(inverse, device=input_ids.device)


def once_per_prompt(prefill):
    """`prefill` (a model's bound `_prefill`) run on the distinct rows alone where it is plainly the same
    computation, its logits and cache repeated back to every row."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # keys and values (batch x heads x positions x dim) alone

    def dedupe(input_ids, generation_config, model_kwargs, is_first_iteration=True, **kwargs):
        cache = model_kwargs.get("past_key_values")
        found = None
        if (is_first_iteration and not kwargs and type(cache) is DynamicCache and cache.layers
                and all(type(layer) in LAYERS for layer in cache.layers) and cache.get_seq_length() == 0
                and model_kwargs.get("inputs_embeds") is None and generation_config.prefill_chunk_size is None):
            found = distinct_rows(input_ids, model_kwargs.get("attention_mask"))
        if found is None:
            return prefill(input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration,
                           **kwargs)
        first, inverse = found
        rows = input_ids.shape[0]
        sub = {k: (v.index_select(0, first) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v)
               for k, v in model_kwargs.items()}
        outputs = prefill(input_ids.index_select(0, first), generation_config, sub, is_first_iteration=True)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
        outputs.logits = outputs.logits.index_select(0, inverse)
        return outputs

    return dedupe


@contextlib.contextmanager
def prefill_once_per_prompt(model):
    """`model`'s generation (a peft model's base model's) prefills each distinct prompt once within."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner._prefill = once_per_prompt(inner._prefill)
    try:
        yield model
    finally:
        del inner._prefill


def dedupe_prefill(trainer, trainer_name: str) -> None:
    """Patch a built GRPO or RLOO trainer: its generation prefills each distinct prompt once."""
    around_generation(trainer, trainer_name,
                      lambda: prefill_once_per_prompt(trainer.accelerator.unwrap_model(trainer.model_wrapped)))
