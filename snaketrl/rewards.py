"""Reward functions for GRPO/RLOO/Online DPO, named in config.

A config entry is a built-in name (`unique_chars`), a `package.module:function`, or a mapping
`{function: NAME, kwargs: {...}}`. Each function takes TRL's (completions, **columns) and returns
one float per completion.
"""

from __future__ import annotations

import functools
import importlib
import re

from snaketrl.errors import ConfigError


def _text(completion) -> str:
    # Conversational completions arrive as [{"role": "assistant", "content": ...}].
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return completion


def unique_chars(completions, **_) -> list[float]:
    """The seed document's example: the number of distinct characters."""
    return [float(len(set(_text(c)))) for c in completions]


def format_match(completions, pattern: str = r"^ ?\S.*[.!?]$", **_) -> list[float]:
    """1.0 where the completion matches `pattern` (default: one sentence ending in . ! or ?)."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.search(_text(c).strip("\n")) else 0.0 for c in completions]


def keyword(completions, words=("feel",), **_) -> list[float]:
    """Share of `words` that the completion contains."""
    return [sum(w in _text(c) for w in words) / len(words) for c in completions]


WORD = re.compile(r"[^\W_]+", re.UNICODE)


def prompt_overlap(completions, prompts, **_) -> list[float]:
    """Share of the completion's words that occur in its prompt (case-insensitive): a summary that
    restates the post's facts (who, what, how they feel) scores 1, invented details less, no words 0."""
    out = []
    for completion, prompt in zip(completions, prompts):
        words = WORD.findall(_text(completion).lower())
        seen = set(WORD.findall(_text(prompt).lower()))
        out.append(sum(w in seen for w in words) / len(words) if words else 0.0)
    return out


FINAL_NUMBER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    match = FINAL_NUMBER.search(text)
    return match.group(1).replace(",", "") if match else None


def last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def accuracy(completions, answer, match: str = "strict", **_) -> list[float]:
    """gsm8k-style exact match of the answer's final number (after `####`) against the completion's: with
    `match: strict` the number after its `####`, with `flexible` its last number (lm-eval gsm8k's two filters; a
    chat model answers in prose, without the `####` it was never shown)."""
    if match not in ("strict", "flexible"):
        raise ConfigError(f"config: reward_funcs: accuracy: match must be strict or flexible, got {match!r}")
    extract = final_number if match == "strict" else last_number
    out = []
    for completion, ref in zip(completions, answer):
        expected = final_number(ref) if "####" in ref else ref.strip()
        got = extract(_text(completion))
        out.append(1.0 if got is not None and got == expected else 0.0)
    return out


ROUGE_KINDS = ("rouge1", "rouge2", "rougeL")


@functools.cache
def _rouge_scorer(kind: str):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind], use_stemmer=True)


def rouge(completions, answer, kind: str = "rougeL", **_) -> list[float]:
    """ROUGE F1 of the completion against the `answer` column (e.g. a post author's own TL;DR), by Google's
    rouge-score: lowercased words, Porter-stemmed; `kind` rouge1 (words), rouge2 (word pairs) or rougeL (the
    longest common subsequence). Graded in [0, 1], so a group of completions differs even where none is right."""
    if kind not in ROUGE_KINDS:
        raise ConfigError(f"config: reward_funcs: rouge: kind must be one of {', '.join(ROUGE_KINDS)}, got {kind!r}")
    scorer = _rouge_scorer(kind)
    return [float(scorer.score(ref, _text(c))[kind].fmeasure) for c, ref in zip(completions, answer)]


BUILTINS = {"unique_chars": unique_chars, "format": format_match, "keyword": keyword, "accuracy": accuracy,
            "prompt_overlap": prompt_overlap, "rouge": rouge}


def resolve_name(name: str):
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ConfigError(f"config: reward_funcs: unknown reward function '{name}'; expected a built-in "
                          f"({', '.join(sorted(BUILTINS))}) or 'package.module:function'")
    module, _, attr = name.partition(":")
    try:
        func = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"config: reward_funcs: cannot import '{name}': {err}") from None
    if not callable(func):
        raise ConfigError(f"config: reward_funcs: '{name}' is not callable")
    return func


def resolve(entries) -> list:
    funcs = []
    for entry in entries:
        if isinstance(entry, str):
            funcs.append(resolve_name(entry))
        else:
            func = functools.partial(resolve_name(entry["function"]), **entry.get("kwargs", {}))
            func.__name__ = entry["function"].rsplit(":", 1)[-1]  # TRL logs rewards/<name>/mean
            funcs.append(func)
    return funcs
