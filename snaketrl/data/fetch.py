"""Fetching a dataset entry: the user's local files (JSON Lines, JSON arrays, parquet) or a Hub dataset,
with a seeded eval hold-out. Lines that are not UTF-8 JSON objects are errors, or dropped under
`bad_rows: drop`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from snaketrl.data.schema import BadRow, Dropped, Sieve, describe
from snaketrl.errors import DataError

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Fetched:
    """A dataset's rows, split. `origin[split]` says where each row came from, for later messages:
    {"file": path, "lines": [1-based line per row]} for JSON Lines and JSON arrays,
    {"file": path, "rows": [0-based index per row]} for parquet,
    {"hub": repo, "split": split, "rows": [0-based index per row]} for Hub datasets."""

    train: list[dict]
    eval: list[dict]
    origin: dict[str, dict]
    dropped: Dropped


# A lone surrogate escape parses, but UTF-8 cannot store it: writing the row would fail later.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class _Part:
    rows: list[dict]
    origin: dict

    def take(self, indices: list[int]) -> _Part:
        key = "lines" if "lines" in self.origin else "rows"
        return _Part([self.rows[i] for i in indices], {**self.origin, key: [self.origin[key][i] for i in indices]})


def _load_file(name: str, path: str, sieve: Sieve) -> _Part:
    suffix = Path(path).suffix
    if suffix not in FILE_FORMATS:
        raise DataError(f"dataset '{name}': file {path}: unsupported format '{suffix}'; expected one of "
                        f"{sorted(FILE_FORMATS)}")
    if not Path(path).is_file():
        raise DataError(f"dataset '{name}': file {path} does not exist")
    if suffix == ".parquet":
        return _read_parquet(name, path)
    data = Path(path).read_bytes()
    # A .json file may hold one array of objects; anything else is read as JSON Lines, as `datasets` does.
    if suffix == ".json" and data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return _read_json_array(name, path, data, sieve)
    return _read_json_lines(path, data, sieve)


def _read_parquet(name: str, path: str) -> _Part:
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(f"dataset '{name}': {path}: not a readable parquet file ({err})") from None
    return _Part(rows, {"file": path, "rows": list(range(len(rows)))})


def _read_json_lines(path: str, data: bytes, sieve: Sieve) -> _Part:
    rows, lines = [], []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            rows.append(_parse_line(raw))
            lines.append(number)
        except BadRow as bad:
            sieve.reject(f"{path} line {number}", bad)
    return _Part(rows, {"file": path, "lines": lines})


def _parse_line(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRow(_not_utf8(raw[err.start], err.start)) from None
    if text.startswith("\ufeff"):  # a byte order mark from an editor: whitespace, keeping columns right
        text = " " + text[1:]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadRow(f"not valid JSON ({err.msg} at column {err.colno})") from None
    return _object(value, text)


def _not_utf8(byte: int, offset: int) -> str:
    return f"not valid UTF-8 (byte 0x{byte:02x} at byte offset {offset} of the line; save the file as UTF-8)"


def _object(value, text: str) -> dict:
    if not isinstance(value, dict):
        raise BadRow(f"expected a JSON object {{...}}, got {describe(value)}")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadRow(f"not valid text: a lone UTF-16 surrogate {err.object[err.start]!r} that UTF-8 cannot "
                         f"store") from None
    return value


def _read_json_array(name: str, path: str, data: bytes, sieve: Sieve) -> _Part:
    """A JSON array cannot be read past a syntax error, so those stop here even under `drop`."""
    try:
        text = data.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as err:
        line, line_start = data.count(b"\n", 0, err.start) + 1, data.rfind(b"\n", 0, err.start) + 1
        raise DataError(f"dataset '{name}': {path} line {line}: {_not_utf8(data[err.start], err.start - line_start)}"
                        ) from None
    rows, lines = [], []
    try:
        for number, value in _array_items(text):
            try:
                rows.append(_object(value, json.dumps(value)))
                lines.append(number)
            except BadRow as bad:
                sieve.reject(f"{path} line {number}", bad)
    except json.JSONDecodeError as err:
        raise DataError(f"dataset '{name}': {path} line {err.lineno}: not valid JSON ({err.msg} at column "
                        f"{err.colno})") from None
    return _Part(rows, {"file": path, "lines": lines})


def _array_items(text: str):
    """(line, value) of each element of a top-level JSON array, so rows keep the line they start on."""
    decoder = json.JSONDecoder()
    pos = _WHITESPACE.match(text, text.index("[") + 1).end()
    line, counted = 1, 0
    while not text.startswith("]", pos):
        value, end = decoder.raw_decode(text, pos)
        line, counted = line + text.count("\n", counted, pos), pos
        yield line, value
        pos = _WHITESPACE.match(text, end).end()
        if text.startswith(",", pos):
            pos = _WHITESPACE.match(text, pos + 1).end()
            if text.startswith("]", pos):
                raise json.JSONDecodeError("Expecting value", text, pos)  # a trailing comma
        elif not text.startswith("]", pos):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
    end = _WHITESPACE.match(text, pos + 1).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)


def _load_hub(name: str, entry: dict, split: str) -> _Part:
    """load_dataset of a Hub id, or of a local directory laid out like a Hub dataset repo."""
    import datasets

    from snaketrl import hub

    repo = os.path.expanduser(entry["hub"])  # `~/data/x`: a local directory
    prefetch = (f"`datasets.load_dataset('{repo}'{', ' + repr(entry['name']) if entry.get('name') else ''})"
                f"[split].to_json(...)` for each split, copy the files here and use `files:` (or a local "
                f"directory as `hub:`)")
    if not Path(repo).is_dir():
        try:
            hub.require("dataset", name, repo, prefetch)
        except hub.HubUnreachable as err:
            raise DataError(str(err)) from None
    try:
        rows = datasets.load_dataset(repo, entry.get("name"), split=split, revision=entry.get("revision")).to_list()
    except Exception as err:  # gated, a typo in the id or split: say what was asked
        raise DataError(f"dataset '{name}': datasets.load_dataset('{repo}', split='{split}') failed: "
                        f"{type(err).__name__}: {err}. To work offline: {prefetch}") from err
    return _Part(rows, {"hub": repo, "split": split, "rows": list(range(len(rows)))})


def fetch(name: str, entry: dict, seed: int) -> Fetched:
    """Train and eval rows of a dataset entry; without an eval part, a seeded share is held out.
    Lines that are not UTF-8 JSON objects are errors, or dropped under `bad_rows: drop`."""
    bad_rows = entry.get("bad_rows", "error")
    sieve = Sieve(name, bad_rows)
    if "files" in entry:
        files = entry["files"] if isinstance(entry["files"], dict) else {"train": entry["files"]}
        train = _load_file(name, files["train"], sieve)
        evals = _load_file(name, files["eval"], sieve) if "eval" in files else None
    else:
        train = _load_hub(name, entry, entry.get("split", "train"))
        evals = _load_hub(name, entry, entry["eval_split"]) if entry.get("eval_split") else None
    sieve.close()
    if entry.get("distinct"):
        seen: set[str] = set()
        train = _first_of_each(name, train, entry["distinct"], seen)
        evals = _first_of_each(name, evals, entry["distinct"], seen) if evals is not None else None
    if evals is None:
        kept, held = split_rows(list(range(len(train.rows))), entry.get("eval_size", 0.1), seed)
        train, evals = train.take(kept), train.take(held)
    if entry.get("max_rows"):
        train = train.take(list(range(min(entry["max_rows"], len(train.rows)))))
    for split, part in (("train", train), ("eval", evals)):
        if not part.rows:
            raise DataError(f"dataset '{name}': the {split} split is empty{sieve.after_dropping()}")
    return Fetched(train.rows, evals.rows, {"train": train.origin, "eval": evals.origin}, sieve.dropped)


def _first_of_each(name: str, part: _Part, column: str, seen: set[str]) -> _Part:
    """The rows whose `column` holds a value no earlier row held (`seen`, shared by the splits: an eval row
    repeating a train row's value is left out too)."""
    key = "lines" if "lines" in part.origin else "rows"
    source = part.origin.get("file", part.origin.get("hub"))
    kept = []
    for i, row in enumerate(part.rows):
        if column not in row:
            raise DataError(f"dataset '{name}': distinct: column '{column}' is missing from {source} "
                            f"{key[:-1]} {part.origin[key][i]}; columns are {list(row)}")
        value = json.dumps(row[column], sort_keys=True)  # a conversation is a list: compared as its JSON
        if value not in seen:
            seen.add(value)
            kept.append(i)
    return part.take(kept)


def split_rows(rows: list, eval_size: float, seed: int) -> tuple[list, list]:
    """A seeded hold-out that keeps file order within each part."""
    import random

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * eval_size)) if len(rows) > 1 else 0
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]
