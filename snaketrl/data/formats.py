"""Dataset formats converted to TRL's columns (alpaca, Anthropic HH), and TRL's conversational checks.
"""

from __future__ import annotations

from snaketrl.data.schema import MISSING, BadRow, describe, in_column, non_empty_text


def is_conversational(value) -> bool:
    """TRL's `data_utils.is_conversational` for one column value; importing trl would cost each job seconds."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def split_prompt(chosen, rejected):
    """The shared beginning of chosen and rejected as the prompt, as TRL's `extract_prompt`: a space before
    the first difference starts the completions (a tokenizer's leading-space word)."""
    n = shared_length(chosen, rejected)
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def shared_length(a, b) -> int:
    """Length of the common start of two strings or message lists."""
    if isinstance(a, str):  # bisect with slice compares: a character loop is slow on long dialogues
        lo, hi = 0, min(len(a), len(b))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
        return lo
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def from_alpaca(row: dict) -> dict:
    """instruction/input/output(/history) -> a conversational prompt and completion (as LLaMA-Factory)."""
    in_column("'instruction'", non_empty_text, row.get("instruction", MISSING))
    if row.get("input") is not None and not isinstance(row["input"], str):
        raise BadRow(f"column 'input': expected a string or null, got {describe(row['input'])}")
    in_column("'output'", non_empty_text, row.get("output", MISSING))
    turns = []
    for user, assistant in _history(row.get("history")):
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    instruction = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return {"prompt": turns + [{"role": "user", "content": instruction}],
            "completion": [{"role": "assistant", "content": row["output"]}]}


def _history(history) -> list:
    if history is None:
        return []
    if not isinstance(history, list):
        raise BadRow(f"column 'history': expected a list of [user, assistant] pairs, got {describe(history)}")
    for n, turn in enumerate(history, 1):
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) and t.strip() for t in turn)):
            raise BadRow(f"column 'history': turn {n}: expected a [user, assistant] pair of non-empty strings, "
                         f"got {describe(turn)}")
    return history


HH_ASSISTANT = "\n\nAssistant:"


def from_hh(row: dict) -> dict:
    """Anthropic HH dialogues: the prompt is the shared text up to the last Assistant turn."""
    for column in ("chosen", "rejected"):
        in_column(f"'{column}'", non_empty_text, row.get(column, MISSING))
    cut = row["chosen"].rfind(HH_ASSISTANT, 0, shared_length(row["chosen"], row["rejected"]))
    if cut < 0:
        raise BadRow(f"columns 'chosen' and 'rejected': expected a shared dialogue up to an {HH_ASSISTANT!r} turn, "
                     f"got none")
    cut += len(HH_ASSISTANT)
    return {"prompt": row["chosen"][:cut], "chosen": row["chosen"][cut:], "rejected": row["rejected"][cut:]}


FORMATS = {"alpaca": (from_alpaca, ("instruction", "output")), "hh": (from_hh, ("chosen", "rejected"))}
