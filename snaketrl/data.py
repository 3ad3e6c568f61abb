"""Datasets: fetch (Hub or local files) and per-trainer preprocessing.

Every step writes JSON Lines; a failing step raises before it writes anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Columns each trainer family consumes, as alternatives (first match wins).
LAYOUTS: dict[str, list[tuple[str, ...]]] = {
    "language_modeling": [("prompt", "completion"), ("messages",), ("text",)],
    "preference": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    # Online trainers pass extra columns to reward functions: keep a gsm8k-style `answer`.
    "prompt": [("prompt", "answer"), ("prompt",)],
}

from snaketrl.errors import DataError

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}




def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _load_files(name: str, path: str) -> list[dict]:
    suffix = Path(path).suffix
    if suffix not in FILE_FORMATS:
        raise DataError(f"dataset '{name}': file {path}: unsupported format '{suffix}'; expected one of "
                        f"{sorted(FILE_FORMATS)}")
    if not Path(path).is_file():
        raise DataError(f"dataset '{name}': file {path} does not exist")
    if suffix == ".jsonl":
        return read_jsonl(path)
    import datasets

    return datasets.load_dataset(FILE_FORMATS[suffix], data_files=path, split="train").to_list()


def _load_hub(name: str, entry: dict, split: str) -> list[dict]:
    """load_dataset of a Hub id, or of a local directory laid out like a Hub dataset repo."""
    import datasets

    from snaketrl import hub

    repo = entry["hub"]
    prefetch = (f"`datasets.load_dataset('{repo}'{', ' + repr(entry['name']) if entry.get('name') else ''})"
                f"[split].to_json(...)` for each split, copy the files here and use `files:` (or a local "
                f"directory as `hub:`)")
    if not Path(repo).is_dir():
        try:
            hub.require("dataset", name, repo, prefetch)
        except hub.HubUnreachable as err:
            raise DataError(str(err)) from None
    try:
        return datasets.load_dataset(repo, entry.get("name"), split=split,
                                     revision=entry.get("revision")).to_list()
    except Exception as err:  # gated, a typo in the id or split: say what was asked
        raise DataError(f"dataset '{name}': datasets.load_dataset('{repo}', split='{split}') failed: "
                        f"{type(err).__name__}: {err}. To work offline: {prefetch}") from err


def fetch(name: str, entry: dict, seed: int) -> tuple[list[dict], list[dict]]:
    """Train and eval rows of a dataset entry; without an eval part, a seeded share is held out."""
    if "files" in entry:
        files = entry["files"] if isinstance(entry["files"], dict) else {"train": entry["files"]}
        train = _load_files(name, files["train"])
        evals = _load_files(name, files["eval"]) if "eval" in files else None
    else:
        train = _load_hub(name, entry, entry.get("split", "train"))
        evals = _load_hub(name, entry, entry["eval_split"]) if entry.get("eval_split") else None
    if evals is None:
        train, evals = split_rows(train, entry.get("eval_size", 0.1), seed)
    if entry.get("max_rows"):
        train = train[: entry["max_rows"]]
    for split, rows in (("train", train), ("eval", evals)):
        if not rows:
            raise DataError(f"dataset '{name}': the {split} split is empty")
    return train, evals


def split_rows(rows: list[dict], eval_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    import random

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * eval_size)) if len(rows) > 1 else 0
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def is_conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _split_prompt(chosen, rejected):
    """The shared prefix of chosen and rejected as the prompt (TRL's implicit-prompt datasets)."""
    if is_conversational(chosen):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        return chosen[:n], chosen[n:], rejected[n:]
    n = len(os.path.commonprefix([chosen, rejected]))
    return chosen[:n], chosen[n:], rejected[n:]


def from_alpaca(row: dict) -> dict:
    """instruction/input/output(/history) -> a conversational prompt and completion (as LLaMA-Factory)."""
    turns = []
    for user, assistant in row.get("history") or []:
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    instruction = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return {"prompt": turns + [{"role": "user", "content": instruction}],
            "completion": [{"role": "assistant", "content": row["output"]}]}


HH_ASSISTANT = "\n\nAssistant:"


def from_hh(row: dict) -> dict:
    """Anthropic HH dialogues: the prompt is the shared text up to the last Assistant turn."""
    prefix = os.path.commonprefix([row["chosen"], row["rejected"]])
    cut = prefix.rfind(HH_ASSISTANT)
    if cut < 0:
        raise DataError(f"HH-style row has no shared '{HH_ASSISTANT.strip()}' turn: {row['chosen'][:80]!r}")
    cut += len(HH_ASSISTANT)
    return {"prompt": row["chosen"][:cut], "chosen": row["chosen"][cut:], "rejected": row["rejected"][cut:]}


FORMATS = {"alpaca": (from_alpaca, ("instruction", "output")), "hh": (from_hh, ("chosen", "rejected"))}


def preprocess(rows: list[dict], *, dataset: str, trainer: str, layout: str, columns: dict[str, str],
               split: str, format: str | None = None) -> list[dict]:
    """Map a dataset's rows to the columns `layout` expects; other columns are dropped."""
    if not rows:
        raise DataError(f"dataset '{dataset}' ({split} split, for trainer '{trainer}'): no rows")
    if format:
        convert, needs = FORMATS[format]
        missing = [c for c in needs if c not in rows[0]]
        if missing:
            raise DataError(f"dataset '{dataset}': format '{format}' needs column '{missing[0]}'; "
                            f"columns are {list(rows[0])}")
        rows = [convert(row) for row in rows]
    present = list(rows[0])
    # Mapping: expected name -> source name. A mapped source must exist.
    for target, source in columns.items():
        if source not in present:
            raise DataError(f"dataset '{dataset}': column mapping {target} -> '{source}': no column '{source}'; "
                            f"columns are {present}")
    renamed = {c: c for c in present} | columns  # expected name -> source column
    for wanted in LAYOUTS[layout]:
        if all(c in renamed for c in wanted):
            break
    else:
        options = " or ".join("(" + ", ".join(w) + ")" for w in LAYOUTS[layout])
        raise DataError(f"dataset '{dataset}': trainer '{trainer}' needs columns {options}; "
                        f"missing '{_first_missing(LAYOUTS[layout][0], renamed)}'; columns are {present} "
                        f"(map names with datasets.{dataset}.columns)")
    out = [{c: row[renamed[c]] for c in wanted} for row in rows]
    if layout == "preference" and "prompt" not in wanted:
        for row in out:
            row["prompt"], row["chosen"], row["rejected"] = _split_prompt(row["chosen"], row["rejected"])
        out = [{k: row[k] for k in ("prompt", "chosen", "rejected")} for row in out]
    return out


def _first_missing(wanted, renamed):
    return next(c for c in wanted if c not in renamed)
