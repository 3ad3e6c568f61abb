"""Likelihood metrics: held-out NLL of reference completions, preference accuracy, a k1 KL estimate.
"""

from __future__ import annotations

import math

import numpy as np

from snaketrl.data.lengths import example_texts, prompt_texts
from snaketrl.evaluate.generation import Generated
from snaketrl.evaluate.loading import Loaded, max_positions

KL_ESTIMATOR = ("k1: mean over completions of sum over completion tokens of log p_run - log p_base, on the run's "
                "own completions")


def encode_pairs(tokenizer, prompts, completions) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per example, as TRL's SFT builds its completion mask: the prompt
    rendered alone, and prompt+completion rendered together (chat template for conversations; plain text
    gets the eos SFT appends); the completion is what follows the prompt's tokens."""

    p_texts, p_special = prompt_texts(tokenizer, list(prompts))
    full_texts, f_special = example_texts(tokenizer, list(prompts), list(completions))
    p_ids = tokenizer(p_texts, add_special_tokens=p_special)["input_ids"]
    f_ids = tokenizer(full_texts, add_special_tokens=f_special)["input_ids"]
    out = []
    for p, f in zip(p_ids, f_ids):
        n = len(p) if f[:len(p)] == p else _common_prefix(p, f)
        out.append((f[:n], f[n:]))
    return out


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def token_logprobs(model, pairs, *, pad_token_id: int, batch_size: int = 16, temperature: float = 1.0,
                   max_length: int | None = None, start_token_id: int | None = None) -> list:
    """log p(token | everything before it) of each completion token, per (prompt ids, completion ids)
    pair. Batches are left-padded with explicit position ids, so every completion ends at the right edge
    and only the last (longest completion + 1) positions' logits are computed where the model allows
    (`logits_to_keep`): a long prompt costs no vocabulary-sized logits. Batches of at most `batch_size` are cut
    from the pairs sorted by length, each ending early rather than be more than MAX_PADDING padding
    (padded_batches): 24 hh-rlhf pairs of 50 to 500 tokens in two batches were half padding and took 32 s, in 8
    batches 18 s. The results come back in the pairs' order. A
    pair too long for `max_length` (default: the model's context) loses prompt tokens from the left, then
    completion tokens from the right; an empty prompt becomes `start_token_id` (default: the pad token)."""
    import torch

    from snaketrl.train.labelled import takes_logits_to_keep

    max_length = max_length or max_positions(model)
    start_token_id = pad_token_id if start_token_id is None else start_token_id
    device = next(model.parameters()).device
    can_keep = takes_logits_to_keep(model)
    cut = []
    for p, c in pairs:
        c = list(c)[:max_length - 1]
        # The first completion token needs a context.
        cut.append((list(p)[-(max_length - len(c)):] or [start_token_id], c))
    out = [None] * len(cut)
    for rows in padded_batches([len(p) + len(c) for p, c in cut], batch_size):
        seqs = [cut[i][0] + cut[i][1] for i in rows]
        n_completion = [len(cut[i][1]) for i in rows]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq)
            mask[i, width - len(seq):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(n_completion) + 1
        kwargs = {"logits_to_keep": keep} if can_keep else {}
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                           **kwargs).logits
        logits = logits[:, -keep:].float()  # positions width-keep .. width-1
        if temperature != 1.0:
            logits = logits / temperature
        # The logit at position j predicts token j+1; log_softmax only where gathered: logit - logsumexp.
        targets = ids[:, width - keep + 1:].to(device)
        lp = (logits[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits[:, :-1].logsumexp(-1)).cpu().numpy()
        for i, (row, n) in enumerate(zip(rows, n_completion)):
            out[row] = np.asarray(lp[i, lp.shape[1] - n:], dtype=np.float64)
    return out


# A batch may hold this share of padding: its rows are cut from pairs sorted by length, and on a CPU a padded
# token costs what a real one does.
MAX_PADDING = 0.1


def padded_batches(lengths: list[int], batch_size: int, max_padding: float | None = None) -> list[list[int]]:
    """Indices of `lengths` in batches of at most `batch_size`, cut from them sorted by length, a batch ending
    early where the next row would make more than `max_padding` (default MAX_PADDING) of it padding."""
    max_padding = MAX_PADDING if max_padding is None else max_padding
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, real = [], 0
    for i in order:
        rows = batches[-1] if batches else None
        # sorted: row i is the batch's longest, the width every row pads to
        if rows and len(rows) < batch_size and (len(rows) + 1) * lengths[i] * (1 - max_padding) <= real + lengths[i]:
            rows.append(i)
            real += lengths[i]
        else:
            batches.append([i])
            real = lengths[i]
    return batches


def completion_nll(model, tokenizer, prompts, completions, *, batch_size: int = 16) -> dict:
    """Held-out NLL of reference completions: loss on completion tokens only (as SFT's completion_only_loss),
    mean per token over all references, and its perplexity."""
    pairs = encode_pairs(tokenizer, prompts, completions)
    lps = token_logprobs(model, pairs, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)
    total = sum(float(-x.sum()) for x in lps)
    n = sum(len(x) for x in lps)
    nll = total / n if n else None
    return {"nll": nll, "perplexity": math.exp(nll) if nll is not None else None, "n_references": len(pairs),
            "n_tokens": n}


def sequence_logps(model, tokenizer, prompts, completions, *, batch_size: int = 16):
    """log p(completion | prompt) summed over the completion's tokens, per example (numpy array)."""
    pairs = encode_pairs(tokenizer, prompts, completions)
    lps = token_logprobs(model, pairs, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)
    return np.array([float(x.sum()) for x in lps])


def preference_accuracy(loaded: Loaded, prompts, chosen, rejected, *, batch_size: int = 16,
                        reference_logps=None) -> tuple[dict, list[dict]]:
    """On held-out pairs:
    - `accuracy`: share of pairs where the run's implicit reward prefers chosen, as DPO's rewards/accuracies:
      (logp_run(chosen) - logp_base(chosen)) > (logp_run(rejected) - logp_base(rejected)), ties not counted
      as wins. Undefined (None) without a base to compare with: the base model itself, a merged model.
    - `logp_accuracy`: share where logp(chosen) > logp(rejected) under the model itself (every row, the base's
      included: what the run starts from).
    - `margin`: mean implicit reward margin (beta = 1), None without a base.
    Also each pair's sequence log-probabilities (logp_chosen, logp_rejected and the base's reference_logp_*).
    `reference_logps`: the base's (chosen, rejected) as its own eval job computed them, instead of computing
    them again with the adapter disabled."""
    model, tok = loaded.model, loaded.tokenizer
    run_c = sequence_logps(model, tok, prompts, chosen, batch_size=batch_size)
    run_r = sequence_logps(model, tok, prompts, rejected, batch_size=batch_size)
    out = {"n_pairs": len(run_c), "logp_accuracy": float((run_c > run_r).mean()) if len(run_c) else None,
           "accuracy": None, "margin": None}
    rows = [{"logp_chosen": float(a), "logp_rejected": float(b)} for a, b in zip(run_c, run_r)]
    if loaded.has_reference and len(run_c):
        if reference_logps is None:
            with loaded.reference():
                reference_logps = (sequence_logps(model, tok, prompts, chosen, batch_size=batch_size),
                                   sequence_logps(model, tok, prompts, rejected, batch_size=batch_size))
        base_c, base_r = (np.asarray(x, dtype=np.float64) for x in reference_logps)
        reward_c, reward_r = run_c - base_c, run_r - base_r
        out["accuracy"] = float((reward_c > reward_r).mean())
        out["margin"] = float((reward_c - reward_r).mean())
        for row, c, r in zip(rows, base_c, base_r):
            row.update(reference_logp_chosen=float(c), reference_logp_rejected=float(r))
    return out, rows


def kl_to_reference(loaded: Loaded, generated: Generated, *, batch_size: int = 16,
                    temperature: float = 1.0) -> list[float] | None:
    """Per completion, sum over its tokens of log p_run - log p_base, on the run's own completions: the
    k1 estimator of KL(run || base) is their mean. Unbiased when the completions were sampled from the run
    (generation.do_sample: true, temperature as given); on greedy completions it is the log-ratio of the
    run's most likely continuations, a proxy. None for a model without a base (the base itself, merged).
    log p_run is the generation's own (Generated.logprobs) where it kept them: only the base runs again."""
    if not loaded.has_reference:
        return None
    pairs = list(zip(generated.prompt_ids, generated.token_ids))
    kw = dict(pad_token_id=loaded.tokenizer.pad_token_id, batch_size=batch_size, temperature=temperature)
    run = generated.logprobs if generated.logprobs is not None else token_logprobs(loaded.model, pairs, **kw)
    with loaded.reference():
        base = token_logprobs(loaded.model, pairs, **kw)
    return [float((r - b).sum()) for r, b in zip(run, base)]
