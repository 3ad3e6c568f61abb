"""Sequence lengths as the trainer will tokenize them, and the max_length they imply."""

from __future__ import annotations

import math
import random

import numpy as np

from snaketrl.data import is_conversational

PERCENTILES = (50, 90, 95, 99, 100)


def _texts(tokenizer, prompts, completions):
    """prompt+completion as one string per example: rendered by the chat template when conversational,
    else concatenated with the eos TRL appends to plain-text completions."""
    if is_conversational(prompts[0] if prompts else completions[0]):
        convs = [list(p) + list(c) for p, c in zip(prompts, completions)]
        return tokenizer.apply_chat_template(convs, tokenize=False), False
    return [p + c + tokenizer.eos_token for p, c in zip(prompts, completions)], True


def prompt_texts(tokenizer, prompts):
    """Prompts as generation starts from them: conversational ones end with the assistant header."""
    if is_conversational(prompts[0]):
        return tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True), False
    return list(prompts), True


def tokenize_prompts(rows: list[dict], tokenizer, max_length: int) -> list[dict]:
    """input_ids of each prompt (PPO's dataset), cut from the left to the histogram's max_length so the
    end of the prompt, where generation continues, survives. Padding (left) happens in the collator."""
    texts, special = prompt_texts(tokenizer, [r["prompt"] for r in rows])
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    return [{"input_ids": x[-max_length:]} for x in ids]


def _count(tokenizer, texts, add_special_tokens) -> np.ndarray:
    # One batched call of the fast tokenizer; chat-rendered text carries its special tokens already.
    ids = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))


def sequence_lengths(rows: list[dict], tokenizer, layout: str) -> np.ndarray:
    """Tokens per example. Preference pairs count the longer of prompt+chosen and prompt+rejected,
    since TRL truncates each to max_length."""
    if layout == "language_modeling":
        if "messages" in rows[0]:
            return _count(tokenizer, tokenizer.apply_chat_template([r["messages"] for r in rows], tokenize=False),
                          False)
        if "text" in rows[0]:
            return _count(tokenizer, [r["text"] + tokenizer.eos_token for r in rows], True)
        texts, special = _texts(tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
        return _count(tokenizer, texts, special)
    if layout == "prompt":
        texts, special = prompt_texts(tokenizer, [r["prompt"] for r in rows])
        return _count(tokenizer, texts, special)
    if layout == "preference":
        prompts = [r["prompt"] for r in rows]
        chosen, special = _texts(tokenizer, prompts, [r["chosen"] for r in rows])
        rejected, _ = _texts(tokenizer, prompts, [r["rejected"] for r in rows])
        return np.maximum(_count(tokenizer, chosen, special), _count(tokenizer, rejected, special))
    raise ValueError(f"no length rule for layout '{layout}'")


def choose_max_length(lengths: np.ndarray, keep_share: float, round_to: int, cap: int | None) -> int:
    """Smallest multiple of `round_to` that keeps `keep_share` of examples whole, at most `cap`."""
    # The k-th shortest example, k = ceil(share * n): at least that share fits whole.
    k = max(1, math.ceil(keep_share * len(lengths) - 1e-9))
    need = int(np.sort(lengths)[k - 1])
    choice = max(round_to, math.ceil(need / round_to) * round_to)
    return min(choice, cap) if cap else choice


def padding_share(lengths: np.ndarray, max_length: int, batch_size: int, seed: int) -> float:
    """Expected share of pad tokens when random batches are padded to their longest (truncated) member."""
    clipped = np.minimum(lengths, max_length)
    order = list(range(len(clipped)))
    random.Random(seed).shuffle(order)
    shuffled = clipped[order]
    padded = sum(len(b) * b.max() for b in np.array_split(shuffled, max(1, math.ceil(len(shuffled) / batch_size))))
    return float(1 - clipped.sum() / padded)


def length_stats(lengths: np.ndarray, *, keep_share: float, round_to: int, cap: int | None, batch_size: int,
                 seed: int) -> dict:
    max_length = choose_max_length(lengths, keep_share, round_to, cap)
    return {
        "n_examples": int(len(lengths)),
        "mean": float(lengths.mean()),
        "percentiles": {f"p{p}": int(np.percentile(lengths, p, method="higher")) for p in PERCENTILES},
        "keep_share": keep_share,
        "round_to": round_to,
        "model_max_positions": cap,
        "max_length": max_length,
        "share_truncated": float((lengths > max_length).mean()),
        "padding_share": padding_share(lengths, max_length, batch_size, seed),
        "batch_size": batch_size,
    }


def plot_histogram(lengths: np.ndarray, stats: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(lengths, bins=min(50, max(10, len(np.unique(lengths)))), color="#4c72b0", alpha=0.8)
    for (name, value), style in zip(stats["percentiles"].items(), [":", "--", "--", "-.", ":"]):
        ax.axvline(value, color="gray", linestyle=style, linewidth=1)
        ax.text(value, ax.get_ylim()[1] * 0.95, name, rotation=90, va="top", ha="right", fontsize=7)
    ax.axvline(stats["max_length"], color="#c44e52", linewidth=2,
               label=f"max_length={stats['max_length']} ({stats['share_truncated']:.1%} truncated)")
    ax.set_xlabel("tokens per example")
    ax.set_ylabel("examples")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def histogram(model_dir, train_file, settings: dict, json_out, png_out, title: str) -> dict:
    """The length stage of one (trainer, dataset, model): lengths as the trainer will tokenize them, the
    max_length they imply (`settings`: keep_share, round_to, batch_size, seed, layout), plot and JSON."""
    from transformers import AutoConfig, AutoTokenizer

    from snaketrl.data import read_jsonl
    from snaketrl.io import atomic, write_json

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cap = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    lengths = sequence_lengths(read_jsonl(train_file), tokenizer, settings["layout"])
    stats = length_stats(lengths, keep_share=settings["keep_share"], round_to=settings["round_to"], cap=cap,
                         batch_size=settings["batch_size"], seed=settings["seed"])
    with atomic(png_out) as tmp:
        plot_histogram(lengths, stats, tmp, title)
    write_json(stats, json_out)
    print(stats)
    return stats


def tokenize_prompt_files(model_dir, lengths_file, splits: dict) -> None:
    """PPO's datasets: each split's prompts (`splits`: name -> (in file, out file)) as token ids."""
    from transformers import AutoTokenizer

    from snaketrl.data import read_jsonl, write_jsonl
    from snaketrl.io import read_json

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_length = read_json(lengths_file)["max_length"]
    for split, (src, dst) in splits.items():
        rows = tokenize_prompts(read_jsonl(src), tokenizer, max_length)
        write_jsonl(rows, dst)
        print(f"{split}: {len(rows)} prompts, at most {max_length} tokens")
