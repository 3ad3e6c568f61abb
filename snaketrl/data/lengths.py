"""Sequence lengths as the trainer will tokenize them, and the max_length they imply."""

from __future__ import annotations

import math
import random

import numpy as np

from snaketrl.data.formats import is_conversational
from snaketrl.errors import DataError
from snaketrl.trainers import REGISTRY

PERCENTILES = (50, 90, 95, 99, 100)


def example_texts(tokenizer, prompts, completions):
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
    if layout == "preference":
        return np.maximum(*pair_lengths(rows, tokenizer))
    if layout == "language_modeling":
        if "messages" in rows[0]:
            return _count(tokenizer, tokenizer.apply_chat_template([r["messages"] for r in rows], tokenize=False),
                          False)
        if "text" in rows[0]:
            return _count(tokenizer, [r["text"] + tokenizer.eos_token for r in rows], True)
        texts, special = example_texts(tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
        return _count(tokenizer, texts, special)
    if layout == "prompt":
        texts, special = prompt_texts(tokenizer, [r["prompt"] for r in rows])
        return _count(tokenizer, texts, special)
    raise ValueError(f"no length rule for layout '{layout}'")


def prompt_lengths(rows: list[dict], tokenizer) -> np.ndarray | None:
    """Tokens of each prompt as generation starts from it (None without prompts)."""
    if "prompt" not in rows[0]:
        return None
    texts, special = prompt_texts(tokenizer, [r["prompt"] for r in rows])
    return _count(tokenizer, texts, special)


def pair_lengths(rows: list[dict], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of prompt+chosen and of prompt+rejected per preference pair."""
    prompts = [r["prompt"] for r in rows]
    chosen, special = example_texts(tokenizer, prompts, [r["chosen"] for r in rows])
    rejected, _ = example_texts(tokenizer, prompts, [r["rejected"] for r in rows])
    return _count(tokenizer, chosen, special), _count(tokenizer, rejected, special)


def choose_max_length(lengths: np.ndarray, keep_share: float, round_to: int, cap: int | None) -> int:
    """Smallest multiple of `round_to` that keeps `keep_share` of examples whole, at most `cap`."""
    # The k-th shortest example, k = ceil(share * n): at least that share fits whole.
    k = max(1, math.ceil(keep_share * len(lengths) - 1e-9))
    need = int(np.sort(lengths)[k - 1])
    choice = max(round_to, math.ceil(need / round_to) * round_to)
    return min(choice, cap) if cap else choice


def batch_efficiency(padded: np.ndarray, real: np.ndarray, batch_size: int, order, rows: int = 1) -> float:
    """Real tokens / tokens processed when the examples, taken in `order`, `batch_size` at a time, are padded
    to their batch's longest (`padded`: each example's longest row after truncation, `rows` rows per example,
    as a preference pair's chosen and rejected; `real`: its tokens over all rows)."""
    order = np.asarray(order, dtype=np.int64)
    padded, real = padded[order], real[order]
    starts = np.arange(0, len(padded), batch_size)
    sizes = np.diff(np.append(starts, len(padded)))
    return float(real.sum() / (rows * (np.maximum.reduceat(padded, starts) * sizes).sum()))


# A second forward pass costs its own overhead: a batch is cut in two only if that saves this many tokens.
MIN_ROW_SPLIT_TOKENS = 32


def row_groups(widths: list[int]) -> list[list[int]]:
    """A batch's rows (indices into `widths`, their real lengths) in one or two groups, each to be padded
    to its own longest row: sorted by length and cut where the two groups process the fewest tokens, if that
    saves at least MIN_ROW_SPLIT_TOKENS. A batch is otherwise padded to its longest row: a preference batch's
    chosen and rejected rows too."""
    order = sorted(range(len(widths)), key=widths.__getitem__)
    ordered = [widths[i] for i in order]
    n = len(order)
    whole = best = n * ordered[-1]
    cut = n
    for k in range(1, n):
        cost = k * ordered[k - 1] + (n - k) * ordered[-1]
        if cost < best:
            best, cut = cost, k
    return [order[:cut], order[cut:]] if whole - best >= MIN_ROW_SPLIT_TOKENS else [order]


def split_efficiency(per_row: np.ndarray, batch_size: int, order) -> float:
    """Real / processed tokens when each batch's rows (`per_row`: an example's rows after truncation, taken in
    `order`) are padded in their row_groups instead of all to the batch's longest."""
    real = processed = 0
    order = np.asarray(order, dtype=np.int64)
    for start in range(0, len(order), batch_size):
        widths = per_row[order[start:start + batch_size]].T.ravel().tolist()  # the collator's row order
        processed += sum(len(group) * max(widths[i] for i in group) for group in row_groups(widths))
        real += sum(widths)
    return real / processed


def padding_share(lengths: np.ndarray, max_length: int, batch_size: int, seed: int, real: np.ndarray | None = None,
                  rows: int = 1) -> float:
    """Expected share of pad tokens when random batches are padded to their longest (truncated) member."""
    clipped = np.minimum(lengths, max_length)
    order = list(range(len(clipped)))
    random.Random(seed).shuffle(order)
    return 1 - batch_efficiency(clipped, clipped if real is None else real, batch_size, order, rows)


# Batches per mega-batch of snaketrl's length-grouped sampler (transformers' cap, without its n / (4 x batch)
# limit, which leaves datasets of fewer than 8 batches ungrouped).
MEGA_BATCHES = 50


def length_grouped_batches(lengths: np.ndarray, batch_size: int, perm) -> list[np.ndarray]:
    """The batches of snaketrl's length-grouped sampler (snaketrl.train.sampler), before it shuffles their order:
    the permutation `perm` cut into mega-batches of MEGA_BATCHES batches (a smaller dataset is one mega-batch),
    each sorted longest first (stable, as transformers' sort) and cut into batches. Only the last batch can be
    short. Plain numpy: the length stage estimates with it and runs without torch."""
    perm = np.asarray(perm, dtype=np.int64)
    size = MEGA_BATCHES * batch_size
    batches = []
    for start in range(0, len(perm), size):
        mega = perm[start:start + size]
        mega = mega[np.argsort(-lengths[mega], kind="stable")]
        batches += [mega[i:i + batch_size] for i in range(0, len(mega), batch_size)]
    return batches


def length_grouped_order(lengths: np.ndarray, batch_size: int, seed: int = 0) -> np.ndarray:
    """An order of the examples whose batches are those snaketrl's sampler forms (the batches' order, which
    it shuffles, changes no batch's padding)."""
    perm = np.random.default_rng(seed).permutation(len(lengths))
    return np.concatenate(length_grouped_batches(lengths, batch_size, perm))


# What each strategy sets in the trainer's TRL config (preference pairs: tokenized by TRL into columns the
# sampler cannot measure, so training adds their lengths as a column, which must survive unused-column removal).
STRATEGY_ARGS = {
    "padded": {},
    "grouped": {"train_sampling_strategy": "group_by_length"},  # snaketrl.train.sampler's sampler
    "packed": {"packing": True, "packing_strategy": "bfd"},
}
PAIR_GROUPING = {"remove_unused_columns": False, "length_column_name": "snaketrl_length"}
# Attention implementations that keep a flattened batch's sequences apart without attending across the
# whole batch (trl.trainer.sft_trainer.FLASH_ATTENTION_VARIANTS, and snaketrl.train.attention's varlen;
# tests/test_batching.py checks they match).
VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2",
                    "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3", "varlen"}
# A strategy other than TRL's default must gain at least this much efficiency to be chosen.
MIN_GAIN = 0.01
# The devices a choice is made for: the train job takes the one it runs on (the length job may run elsewhere).
DEVICES = ("cpu", "cuda")
# What was measured on CUDA (issue 18: SFT of a Qwen2.5-0.5B-shaped model on LIMA, one H100, bf16, sdpa, real
# tokens/s against TRL's default): packing 1.4x, length-grouped batches run in two row groups 0.6x (two smaller
# forwards leave the GPU idle between them). On a CPU every saved token is saved time and packing is 1.5-4.6x
# slower (docs/batching.md).
CUDA_PACKED = ("on CUDA packing measured 1.4x TRL's default real tokens/s (an H100, SFT of a Qwen2.5-0.5B shape "
               "on LIMA) and is exact: TRL's padding-free batches carry position_ids that restart per sequence; the "
               "train job attends within each sequence with torch's varlen kernel (snaketrl.train.attention, 2.0x "
               "sdpa's dense block-diagonal mask on an H200) unless models.<name>.attn_implementation says otherwise")
CUDA_NO_ROW_GROUPS = ("no row groups on CUDA: two smaller forwards per batch measured 0.6x TRL's default on an "
                      "H100, where a forward's cost hardly grows with its width")


def choose_batching(trainer: str, requested: str, attention: str | None, efficiency: dict[str, float],
                    device: str = "cpu") -> dict:
    """The batching of one (trainer, dataset, model) on `device`: `requested` (length.batching) or, for `auto`,
    the best the trainer allows given the expected `efficiency` of each strategy, the model's attention and what
    was measured on that device. Efficiencies of `grouped` count its row groups where the trainer splits rows."""
    spec = REGISTRY[trainer]
    options = spec.batching
    if requested != "auto":
        strategy, reason = requested, "set by length.batching"
    elif len(options) == 1:
        strategy, reason = "padded", spec.batching_note
    elif device == "cuda" and "packed" in options:
        strategy, reason = "packed", CUDA_PACKED
    elif "packed" in options and attention in VARLEN_ATTENTION:
        strategy = "packed"
        reason = (f"best-fit-decreasing packing, padding-free: {attention} attends within each packed "
                  f"sequence only, so no token is padding and none is wasted on cross-sequence attention")
    elif efficiency["grouped" if device == "cpu" else "grouped_whole"] - efficiency["padded"] < MIN_GAIN:
        strategy = "padded"
        reason = (f"TRL's random batches are already {efficiency['padded']:.1%} real tokens; grouping by length "
                  f"would gain less than {MIN_GAIN:.0%}")
    else:
        strategy = "grouped"
        reason = "batches grouped by length (snaketrl.train.sampler, batch order shuffled) pad only to their neighbours"
        if "packed" in options:
            reason += (f"; packing would be exact but flattens each batch into one sequence, and with "
                       f"{attention or 'the default (sdpa)'} attention that sequence's attention cost grows with "
                       f"the square of its length: it pays with flash attention (models.<name>.attn_implementation)")
    args = dict(STRATEGY_ARGS[strategy])
    if strategy == "grouped" and spec.layout == "preference":
        args.update(PAIR_GROUPING)
    split = strategy == "grouped" and spec.split_rows and device != "cuda"
    if split:
        reason += (f"; each batch's rows run as two length groups, each padded to its own longest row, where "
                   f"that saves at least {MIN_ROW_SPLIT_TOKENS} tokens (snaketrl.train.batching)")
    elif strategy == "grouped" and spec.split_rows:
        reason += f"; {CUDA_NO_ROW_GROUPS}"
    expected = efficiency["grouped_whole" if strategy == "grouped" and not split else strategy]
    return {"strategy": strategy, "requested": requested, "args": args, "split_rows": split, "reason": reason,
            "expected_efficiency": expected, "padding_efficiency": efficiency["padded"], "device": device}


def strategy_efficiencies(lengths: np.ndarray, real: np.ndarray, max_length: int, batch_size: int, seed: int,
                          rows: int = 1, split: np.ndarray | None = None) -> dict[str, float]:
    """Expected real/processed tokens of each strategy: TRL's random batches, length-grouped batches (with
    `split`, each example's truncated rows: their batch is padded in row groups), and padding-free packing
    (every processed token is real: sequences are concatenated, not padded)."""
    clipped = np.minimum(lengths, max_length)
    grouped = length_grouped_order(clipped, batch_size, seed)
    whole = batch_efficiency(clipped, real, batch_size, grouped, rows)  # each batch padded as one
    return {"padded": 1 - padding_share(lengths, max_length, batch_size, seed, real, rows),
            "grouped": whole if split is None else split_efficiency(split, batch_size, grouped),
            "grouped_whole": whole, "packed": 1.0}


def length_stats(lengths: np.ndarray, *, keep_share: float, round_to: int, cap: int | None, batch_size: int,
                 seed: int, trainer: str | None = None, batching: str = "auto", attention: str | None = None,
                 prompts: np.ndarray | None = None, ceiling: int | None = None) -> dict:
    """Percentiles, max_length and batching of `lengths`: one per example, or one column per row the trainer
    pads together (a preference pair's prompt+chosen and prompt+rejected); `prompts`: each prompt's tokens.
    `cap`: the model's positions; `ceiling`: length.max_length, a ceiling set for compute. Without `trainer`,
    no batching."""
    per_row = lengths.reshape(len(lengths), -1)
    longest = per_row.max(axis=1)
    chosen = choose_max_length(longest, keep_share, round_to, cap)
    max_length = min(chosen, ceiling) if ceiling else chosen
    drops = REGISTRY[trainer].drops if trainer else ""
    # What a trainer drops it never sees; everything else is truncated to max_length, row by row.
    kept = np.ones(len(longest), dtype=bool)
    if drops == "long":
        kept = longest <= max_length
    elif drops == "long_prompt" and prompts is not None:
        kept = prompts < max_length
    if not kept.any():
        limit = f"length.max_length: {ceiling}" if max_length == ceiling else f"the model has {cap} positions"
        raise DataError(f"trainer '{trainer}' drops every example at max_length={max_length} ({limit}): nothing "
                        f"would be left to train on")
    truncated = np.minimum(per_row[kept], max_length)
    split = truncated if trainer and REGISTRY[trainer].split_rows else None
    efficiency = strategy_efficiencies(longest[kept], truncated.sum(axis=1), max_length, batch_size, seed,
                                       rows=per_row.shape[1], split=split)
    stats = {
        "n_examples": int(len(longest)),
        "mean": float(longest.mean()),
        "percentiles": {f"p{p}": int(np.percentile(longest, p, method="higher")) for p in PERCENTILES},
        "keep_share": keep_share,
        "round_to": round_to,
        "model_max_positions": cap,
        # What keep_share chose, and the ceiling (length.max_length) that may have lowered it.
        "keep_share_max_length": chosen,
        "max_length_ceiling": ceiling,
        "max_length": max_length,
        "share_truncated": 0.0 if drops == "long" else float((longest > max_length).mean()),
        "dropped": int((~kept).sum()),
        # Real tokens an example trains on (every row, each truncated): what a run's max_tokens divides by.
        "mean_tokens": float(truncated.sum(axis=1).mean()),
        "padding_share": 1 - efficiency["padded"],
        "batch_size": batch_size,
    }
    if trainer:
        # `batching`: the choice for a CPU (what the histogram shows); the train job takes its device's.
        stats["batching_by_device"] = {d: choose_batching(trainer, batching, attention, efficiency, d) for d in DEVICES}
        stats["batching"] = stats["batching_by_device"]["cpu"]
        if stats["batching"]["strategy"] == "packed":
            stats["dropped"] = 0  # TRL packs every example, even one whose completion is cut off
    return stats


def plot_histogram(lengths: np.ndarray, stats: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(lengths, bins=min(50, max(10, len(np.unique(lengths)))), color="#4c72b0", alpha=0.8)
    for (name, value), style in zip(stats["percentiles"].items(), [":", "--", "--", "-.", ":"]):
        ax.axvline(value, color="gray", linestyle=style, linewidth=1)
        ax.text(value, ax.get_ylim()[1] * 0.95, name, rotation=90, va="top", ha="right", fontsize=7)
    cut = (f"{stats['dropped']} dropped" if stats["dropped"] else f"{stats['share_truncated']:.1%} truncated")
    if stats.get("max_length_ceiling") and stats["max_length"] < stats["keep_share_max_length"]:
        cut += f"; length.max_length ceiling, keep_share chose {stats['keep_share_max_length']}"
    ax.axvline(stats["max_length"], color="#c44e52", linewidth=2, label=f"max_length={stats['max_length']} ({cut})")
    if "batching" in stats:
        b = stats["batching"]
        ax.plot([], [], " ", label=f"batching: {b['strategy']}, {b['expected_efficiency']:.0%} real tokens "
                                   f"(TRL's default {b['padding_efficiency']:.0%})")
    ax.set_xlabel("tokens per example")
    ax.set_ylabel("examples")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def histogram(model_dir, train_file, settings: dict, json_out, png_out, title: str, model: str = "?",
              dataset: str = "?") -> dict:
    """The length stage of one (trainer, dataset, model): lengths as the trainer will tokenize them (as chat
    turns where `settings` says `chat`), the max_length they imply and the batching to train with (`settings`:
    trainer, layout, keep_share, round_to, max_length (a ceiling), batch_size, seed, batching,
    attn_implementation, trust_remote_code), plot and JSON. The JSON records `chat` and `trust_remote_code` for
    PPO's prompt tokenization."""
    from transformers import AutoConfig, AutoTokenizer

    from snaketrl.data.chat import chat_rows
    from snaketrl.imports import imports_done
    from snaketrl.io import atomic, read_jsonl, write_json
    from snaketrl.remote_code import param, trusted

    trust = trusted(settings)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    imports_done()
    cap = getattr(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust), "max_position_embeddings", None)
    chat = settings.get("chat", False)
    rows = chat_rows(read_jsonl(train_file), chat, tokenizer, model=model, dataset=dataset, where=title)
    if settings["layout"] == "preference":
        lengths = np.stack(pair_lengths(rows, tokenizer), axis=1)
    else:
        lengths = sequence_lengths(rows, tokenizer, settings["layout"])
    drops_prompts = REGISTRY[settings["trainer"]].drops == "long_prompt"
    stats = length_stats(lengths, keep_share=settings["keep_share"], round_to=settings["round_to"], cap=cap,
                         batch_size=settings["batch_size"], seed=settings["seed"], trainer=settings["trainer"],
                         batching=settings["batching"], attention=settings["attn_implementation"],
                         prompts=prompt_lengths(rows, tokenizer) if drops_prompts else None,
                         ceiling=settings.get("max_length"))
    stats["chat"] = chat
    stats.update(param(settings))
    with atomic(png_out) as tmp:
        plot_histogram(lengths.reshape(len(lengths), -1).max(axis=1), stats, tmp, title)
    write_json(stats, json_out)
    print(stats)
    return stats


def tokenize_prompt_files(model_dir, lengths_file, splits: dict) -> None:
    """PPO's datasets: each split's prompts (`splits`: name -> (in file, out file)) as token ids, as chat turns
    where the length histogram (`lengths_file`) measured them so (its template checked there)."""
    from transformers import AutoTokenizer

    from snaketrl.data.chat import as_chat
    from snaketrl.imports import imports_done
    from snaketrl.io import read_json, read_jsonl, write_jsonl
    from snaketrl.remote_code import trusted

    lengths = read_json(lengths_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trusted(lengths))
    imports_done()
    max_length = lengths["max_length"]
    for split, (src, dst) in splits.items():
        rows = read_jsonl(src)
        rows = tokenize_prompts(as_chat(rows) if lengths.get("chat") else rows, tokenizer, max_length)
        write_jsonl(rows, dst)
        print(f"{split}: {len(rows)} prompts, at most {max_length} tokens")
