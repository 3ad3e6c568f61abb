"""Completions of a set of prompts, batched, greedy unless asked to sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from snaketrl.data.lengths import prompt_texts
from snaketrl.evaluate.loading import max_positions


def _stop_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


# What a generation batch's logits may hold when their log-probabilities are kept (32 steps of 16 rows of SmolLM2's
# 49,152-token vocabulary: 100 MB).
LOGITS_BYTES = 1 << 30


@dataclass
class Generated:
    texts: list[str]  # decoded, special tokens dropped
    n_tokens: list[int]  # generated tokens, the closing eos included (as TRL's completions/mean_length)
    token_ids: list[list[int]] = field(repr=False)  # those tokens
    prompt_ids: list[list[int]] = field(repr=False)  # the prompt as the model saw it (unpadded)
    # log p of each generated token under the distribution it was drawn from (the logits at `temperature`, before
    # top_p: what the k1 KL estimate takes for the run's log-probabilities)
    logprobs: list | None = field(default=None, repr=False)


def generate(model, tokenizer, prompts, *, max_new_tokens: int, do_sample: bool = False, batch_size: int = 16,
             temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
             logprobs: bool = False) -> Generated:
    """One completion per prompt, in batches, left-padded; conversational prompts through the chat
    template (snaketrl.data.lengths.prompt_texts). Greedy unless do_sample (then top_k is off, so the k1 KL
    estimate sees the distribution sampled from). Prompts longer than the model's context minus
    max_new_tokens keep their end."""
    import torch
    from transformers import GenerationConfig, set_seed

    if not prompts:
        return Generated([], [], [], [], [])
    texts, special = prompt_texts(tokenizer, list(prompts))
    keep = max(1, max_positions(model) - max_new_tokens)
    prompt_ids = [ids[-keep:] for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]
    stops = _stop_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=stops, **({"temperature": temperature, "top_p": top_p, "top_k": 0}
                                                     if do_sample else {}))
    if seed is not None:
        set_seed(seed)
    device = next(model.parameters()).device
    # `logprobs`: keep the generated tokens' log-probabilities (Generated.logprobs), where a batch's logits, one
    # vocabulary row per token generated, fit in LOGITS_BYTES; else None, and the KL estimate runs the model again.
    vocab = model.get_output_embeddings().weight.shape[0]
    keep = logprobs and min(batch_size, len(prompt_ids)) * max_new_tokens * vocab * 4 <= LOGITS_BYTES
    out_ids, kept = [], []
    for start in range(0, len(prompt_ids), batch_size):
        batch = tokenizer.pad({"input_ids": prompt_ids[start:start + batch_size]}, padding=True,
                              padding_side="left", return_tensors="pt").to(device)
        with torch.inference_mode():
            out = model.generate(**batch, generation_config=config, output_logits=keep, return_dict_in_generate=True)
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            # per step, the chosen token's log-probability: no (rows x steps x vocabulary) float32 copy at once
            lps = torch.stack([(logits.float() / (temperature if do_sample else 1.0)).log_softmax(-1)
                               .gather(-1, new[:, t:t + 1]).squeeze(-1) for t, logits in enumerate(out.logits)],
                              dim=1).cpu().numpy() if keep else [None] * len(new)
        for row, lp in zip(new.tolist(), lps):
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            out_ids.append(row[:cut])
            kept.append(lp[:cut].astype("float64") if keep else None)
    return Generated([tokenizer.decode(ids, skip_special_tokens=True) for ids in out_ids],
                     [len(ids) for ids in out_ids], out_ids, prompt_ids, kept if keep else None)
