"""Scores of completions (reward functions, trained reward models) and their aggregates.
"""

from __future__ import annotations

import math

from snaketrl.data.formats import is_conversational
from snaketrl.data.reward_text import plain_reward_text
from snaketrl.errors import ConfigError, DataError
from snaketrl.evaluate.kinds import reward_func_name, score_name
from snaketrl.evaluate.loading import max_positions


def _as_completions(prompts, completions):
    """Completions as reward functions and judges get them: messages where the prompts are."""
    if prompts and is_conversational(prompts[0]):
        return [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
    return list(completions)


def reward_function_scores(entries, prompts, completions, columns: dict | None = None) -> dict[str, list[float]]:
    """score name (fn_<function>) -> one float per completion, each configured reward function called
    as TRL calls it: f(prompts=..., completions=..., **other dataset columns)."""
    from snaketrl.rewards import resolve

    columns = columns or {}
    comps = _as_completions(prompts, completions)
    out = {}
    for entry, func in zip(entries, resolve(entries)):
        name = score_name("fn", reward_func_name(entry))
        values = func(prompts=list(prompts), completions=comps, **columns)
        if len(values) != len(comps):
            raise DataError(f"reward function '{reward_func_name(entry)}' returned {len(values)} scores for "
                            f"{len(comps)} completions")
        out[name] = [float("nan") if v is None else float(v) for v in values]
    return out


def judge_texts(tokenizer, prompts, completions) -> tuple[list[str], bool]:
    """prompt+completion as text in a judge's own format: its chat template for conversations, else
    prompt + completion + its eos, as TRL's RewardTrainer trained it. Returns (texts, add_special_tokens)."""
    comps = _as_completions(prompts, completions)
    if prompts and is_conversational(prompts[0]):
        if not tokenizer.chat_template:
            raise ConfigError(f"evaluation.reward_models: the judge's tokenizer ({tokenizer.name_or_path}) has no chat "
                              f"template, and the prompts are conversations")
        return tokenizer.apply_chat_template([list(p) + list(c) for p, c in zip(prompts, comps)], tokenize=False), False
    return [plain_reward_text(p + c, tokenizer) for p, c in zip(prompts, comps)], True


def reward_model_scores(reward_dir, prompts, completions, *, batch_size: int = 16,
                        trust_remote_code: bool = False) -> list[float]:
    """A reward model's score (logit of its single label) per completion. It reads text, re-tokenized
    with its own tokenizer, so a reward model of another family judges as well."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_dir, trust_remote_code=trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, trust_remote_code=trust_remote_code)
    if model.config.num_labels != 1:
        raise ConfigError(f"evaluate: {reward_dir} has {model.config.num_labels} labels; a reward model has one")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()
    texts, special = judge_texts(tokenizer, list(prompts), list(completions))
    tokenizer.truncation_side = "left"  # a text too long keeps its end: the completion being judged
    limit = max_positions(model, tokenizer.model_max_length)
    scores = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], padding=True, padding_side="right", truncation=True,
                        max_length=limit, add_special_tokens=special, return_tensors="pt").to(device)
        with torch.inference_mode():
            scores += model(**enc).logits[:, 0].float().tolist()
    del model
    return scores


def _finite(values):
    return [v for v in values if v is not None and not math.isnan(v)]


def mean_std(values) -> dict:
    """mean and (population) std of the finite values; None for none."""
    vals = _finite(values)
    if not vals:
        return {"mean": None, "std": None}
    mean = sum(vals) / len(vals)
    return {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))}


def win_rate(scores, reference) -> float | None:
    """Share of prompts where the run's completion scores above the reference's for the same prompt;
    a tie counts 0.5; pairs with a missing (None/NaN) score are left out."""
    pairs = [(a, b) for a, b in zip(scores, reference, strict=True)
             if a is not None and b is not None and not math.isnan(a) and not math.isnan(b)]
    if not pairs:
        return None
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)


def distinct_n(texts, n: int = 2) -> float | None:
    """Unique word n-grams / all word n-grams over all completions (words: whitespace-split, so runs of
    models with different tokenizers compare). n-grams do not cross completions. None when there are none."""
    total, unique = 0, set()
    for text in texts:
        words = text.split()
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        total += len(grams)
        unique.update(grams)
    return len(unique) / total if total else None
