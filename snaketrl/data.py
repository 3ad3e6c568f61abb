"""Datasets: fetch (Hub or local files) and per-trainer preprocessing.

Every step writes JSON Lines; a failing step raises before it writes anything. A bad row is named by
where the user can find it: their file and line (or a Hub split and row index), its column, and
what was expected there. Under `bad_rows: drop` bad rows are left out and counted instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from snaketrl.errors import ConfigError, DataError

# Columns each trainer family consumes, as alternatives (first match wins).
LAYOUTS: dict[str, list[tuple[str, ...]]] = {
    "language_modeling": [("prompt", "completion"), ("messages",), ("text",)],
    "preference": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    # Online trainers pass extra columns to reward functions: keep a gsm8k-style `answer`.
    "prompt": [("prompt", "answer"), ("prompt",)],
}

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BAD_ROWS = ("error", "drop")
ROLES = ("system", "user", "assistant", "tool")
# Reasons kept per step: enough to see the pattern, not a second copy of a broken dataset.
MAX_REASONS = 100


class BadRow(DataError):
    """What is wrong with one row, worded without its location (the caller knows where it came from)."""


@dataclass
class Dropped:
    """Rows left out under `bad_rows: drop`: how many, and why (the first MAX_REASONS)."""

    count: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)

    def to_json(self) -> dict:
        return {"count": self.count, "reasons": self.reasons, "reasons_omitted": self.count - len(self.reasons)}


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


@dataclass(frozen=True)
class Prepared:
    rows: list[dict]
    dropped: Dropped


class _Sieve:
    """Keeps count of bad rows. Under `error` it still reads on, so the error can say how many more there are."""

    def __init__(self, dataset: str, bad_rows: str):
        if bad_rows not in BAD_ROWS:
            raise ConfigError(f"dataset '{dataset}': bad_rows must be one of {', '.join(BAD_ROWS)}, got {bad_rows!r}")
        self.dataset, self.drop = dataset, bad_rows == "drop"
        self.dropped = Dropped()

    def reject(self, where: str, problem: BadRow) -> None:
        self.dropped.add(f"{where}: {problem}")

    def close(self) -> None:
        if not self.drop and self.dropped.count:
            more = self.dropped.count - 1
            hint = (f" (and {more} more bad row{'s' * (more > 1)}; datasets.{self.dataset}.bad_rows: drop skips them)"
                    if more else "")
            raise DataError(f"dataset '{self.dataset}': {self.dropped.reasons[0]}{hint}")

    def after_dropping(self) -> str:
        n = self.dropped.count
        return f" after dropping {n} bad row{'s' * (n > 1)} (first: {self.dropped.reasons[0]})" if n else ""

    def none_left(self, what: str) -> DataError:
        return DataError(f"{what}: no rows left{self.after_dropping()}")


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a file this workflow wrote (user files go through `fetch`)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written file."""
    from snaketrl.io import atomic

    with atomic(path) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


# --- Reading the user's files ------------------------------------------------------------------

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


def _load_file(name: str, path: str, sieve: _Sieve) -> _Part:
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


def _read_json_lines(path: str, data: bytes, sieve: _Sieve) -> _Part:
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
        raise BadRow(f"expected a JSON object {{...}}, got {_describe(value)}")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadRow(f"not valid text: a lone UTF-16 surrogate {err.object[err.start]!r} that UTF-8 cannot "
                         f"store") from None
    return value


def _read_json_array(name: str, path: str, data: bytes, sieve: _Sieve) -> _Part:
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
        rows = datasets.load_dataset(repo, entry.get("name"), split=split, revision=entry.get("revision")).to_list()
    except Exception as err:  # gated, a typo in the id or split: say what was asked
        raise DataError(f"dataset '{name}': datasets.load_dataset('{repo}', split='{split}') failed: "
                        f"{type(err).__name__}: {err}. To work offline: {prefetch}") from err
    return _Part(rows, {"hub": repo, "split": split, "rows": list(range(len(rows)))})


def fetch(name: str, entry: dict, seed: int) -> Fetched:
    """Train and eval rows of a dataset entry; without an eval part, a seeded share is held out.
    Lines that are not UTF-8 JSON objects are errors, or dropped under `bad_rows: drop`."""
    bad_rows = entry.get("bad_rows", "error")
    sieve = _Sieve(name, bad_rows)
    if "files" in entry:
        files = entry["files"] if isinstance(entry["files"], dict) else {"train": entry["files"]}
        train = _load_file(name, files["train"], sieve)
        evals = _load_file(name, files["eval"], sieve) if "eval" in files else None
    else:
        train = _load_hub(name, entry, entry.get("split", "train"))
        evals = _load_hub(name, entry, entry["eval_split"]) if entry.get("eval_split") else None
    sieve.close()
    if evals is None:
        kept, held = split_rows(list(range(len(train.rows))), entry.get("eval_size", 0.1), seed)
        train, evals = train.take(kept), train.take(held)
    if entry.get("max_rows"):
        train = train.take(list(range(min(entry["max_rows"], len(train.rows)))))
    for split, part in (("train", train), ("eval", evals)):
        if not part.rows:
            raise DataError(f"dataset '{name}': the {split} split is empty{sieve.after_dropping()}")
    return Fetched(train.rows, evals.rows, {"train": train.origin, "eval": evals.origin}, sieve.dropped)


def split_rows(rows: list, eval_size: float, seed: int) -> tuple[list, list]:
    """A seeded hold-out that keeps file order within each part."""
    import random

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * eval_size)) if len(rows) > 1 else 0
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


# --- Row checks --------------------------------------------------------------------------------

_MISSING = object()


def _describe(value) -> str:
    if value is _MISSING:
        return "nothing (the row has no such column)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return "an empty string" if not value else "a whitespace-only string" if not value.strip() else "a string"
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _quote(value) -> str:
    """A value from the data inside a one-line message: escaped, and short."""
    if not isinstance(value, str):
        return _describe(value)
    return repr(value if len(value) <= 40 else value[:40] + "...")


def _text(value) -> None:
    if not (isinstance(value, str) and value.strip()):
        raise BadRow(f"expected a non-empty string, got {_describe(value)}")


CONVERSATION = "a non-empty list of {role, content} messages"


def _conversation(value) -> None:
    if not (isinstance(value, list) and value):
        raise BadRow(f"expected {CONVERSATION}, got {_describe(value)}")
    for n, message in enumerate(value, 1):
        try:
            _message(message)
        except BadRow as bad:
            raise BadRow(f"message {n}: {bad}") from None


def _message(message) -> None:
    if not isinstance(message, dict):
        raise BadRow(f"expected an object with 'role' and 'content', got {_describe(message)}")
    if "role" not in message or "content" not in message:
        keys = ", ".join(map(repr, message)) or "none"
        raise BadRow(f"expected keys 'role' and 'content', got keys {keys}")
    if message["role"] not in ROLES:
        raise BadRow(f"expected a role among {', '.join(ROLES)}, got {_quote(message['role'])}")
    content = message["content"]
    # An empty system message is a common export artefact and harmless; an empty turn is not.
    if not (isinstance(content, str) and (content.strip() or message["role"] == "system")):
        raise BadRow(f"content: expected a non-empty string, got {_describe(content)}")


def _kind(value) -> str | None:
    return "string" if isinstance(value, str) else "conversation" if isinstance(value, list) else None


def _in_column(label: str, check, value) -> None:
    try:
        check(value)
    except BadRow as bad:
        raise BadRow(f"column {label}: {bad}") from None


def _check_texts(values: dict, labels: dict) -> None:
    """prompt/completion/chosen/rejected: all strings or all conversations, each non-empty."""
    kinds = {c: _kind(v) for c, v in values.items() if _kind(v)}
    first = next(iter(kinds), None)
    other = next((c for c in kinds if kinds[c] != kinds[first]), None)
    if other:
        raise BadRow(f"columns {labels[first]} and {labels[other]}: expected both strings or both conversations, "
                     f"got a {kinds[first]} and a {kinds[other]}")
    for column, value in values.items():
        if not first:
            raise BadRow(f"column {labels[column]}: expected a non-empty string or {CONVERSATION}, "
                         f"got {_describe(value)}")
        _in_column(labels[column], _text if kinds[first] == "string" else _conversation, value)


TEXT_COLUMNS = ("prompt", "completion", "chosen", "rejected")
CHECKS = {"messages": _conversation, "text": _text, "answer": _text}


def _shape(row: dict, wanted: tuple[str, ...], sources: dict[str, str], labels: dict[str, str]) -> dict:
    """One output row, checked: its columns in `wanted`, renamed from their `sources`."""
    out = {c: row.get(sources[c], _MISSING) for c in wanted}
    texts = {c: out[c] for c in wanted if c in TEXT_COLUMNS}
    if texts:
        _check_texts(texts, labels)
    for column in wanted:
        if column in CHECKS:
            _in_column(labels[column], CHECKS[column], out[column])
    if "chosen" in out and "prompt" not in out:
        out = _implicit_prompt(out, labels)
    return out


def _implicit_prompt(row: dict, labels: dict) -> dict:
    prompt, chosen, rejected = _split_prompt(row["chosen"], row["rejected"])
    if not (prompt.strip() if isinstance(prompt, str) else prompt):
        raise BadRow(f"columns {labels['chosen']} and {labels['rejected']}: expected a shared beginning (the prompt, "
                     f"as there is no 'prompt' column), got none")
    for column, rest, other in (("chosen", chosen, "rejected"), ("rejected", rejected, "chosen")):
        if isinstance(rest, str) and not rest.strip():
            raise BadRow(f"column {labels[column]}: expected a non-empty string after the prompt it shares with "
                         f"{labels[other]}, got {_describe(rest)}")
        if not rest:
            raise BadRow(f"column {labels[column]}: expected messages after the prompt it shares with "
                         f"{labels[other]}, got none")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def is_conversational(value) -> bool:
    """TRL's `data_utils.is_conversational` for one column value; importing trl would cost each job seconds."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _split_prompt(chosen, rejected):
    """The shared beginning of chosen and rejected as the prompt, as TRL's `extract_prompt`: a space before
    the first difference starts the completions (a tokenizer's leading-space word)."""
    n = _shared_length(chosen, rejected)
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _shared_length(a, b) -> int:
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


# --- Formats -----------------------------------------------------------------------------------

def from_alpaca(row: dict) -> dict:
    """instruction/input/output(/history) -> a conversational prompt and completion (as LLaMA-Factory)."""
    _in_column("'instruction'", _text, row.get("instruction", _MISSING))
    if row.get("input") is not None and not isinstance(row["input"], str):
        raise BadRow(f"column 'input': expected a string or null, got {_describe(row['input'])}")
    _in_column("'output'", _text, row.get("output", _MISSING))
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
        raise BadRow(f"column 'history': expected a list of [user, assistant] pairs, got {_describe(history)}")
    for n, turn in enumerate(history, 1):
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) and t.strip() for t in turn)):
            raise BadRow(f"column 'history': turn {n}: expected a [user, assistant] pair of non-empty strings, "
                         f"got {_describe(turn)}")
    return history


HH_ASSISTANT = "\n\nAssistant:"


def from_hh(row: dict) -> dict:
    """Anthropic HH dialogues: the prompt is the shared text up to the last Assistant turn."""
    for column in ("chosen", "rejected"):
        _in_column(f"'{column}'", _text, row.get(column, _MISSING))
    cut = row["chosen"].rfind(HH_ASSISTANT, 0, _shared_length(row["chosen"], row["rejected"]))
    if cut < 0:
        raise BadRow(f"columns 'chosen' and 'rejected': expected a shared dialogue up to an {HH_ASSISTANT!r} turn, "
                     f"got none")
    cut += len(HH_ASSISTANT)
    return {"prompt": row["chosen"][:cut], "chosen": row["chosen"][cut:], "rejected": row["rejected"][cut:]}


FORMATS = {"alpaca": (from_alpaca, ("instruction", "output")), "hh": (from_hh, ("chosen", "rejected"))}


# --- Preprocessing -----------------------------------------------------------------------------

def preprocess(rows: list[dict], *, dataset: str, trainer: str, layout: str, columns: dict[str, str],
               split: str, format: str | None = None, origin: dict | str | None = None,
               bad_rows: str = "error") -> Prepared:
    """Map a dataset's rows to the columns `layout` expects (other columns are dropped), checking every row.

    `origin` names where row i came from in messages: one split's entry of `Fetched.origin`, or the path
    of the file the rows were read from (row i is its line i+1), or None ("train split row i")."""
    what = f"dataset '{dataset}' ({split} split, for trainer '{trainer}')"
    if not rows:
        raise DataError(f"{what}: no rows")
    where = _locator(origin, split, len(rows))
    sieve = _Sieve(dataset, bad_rows)
    numbered = list(enumerate(rows))
    if format:
        numbered = _convert(numbered, format, dataset, sieve, where)
        where = _after_format(where, format)
        if not numbered:
            raise sieve.none_left(what)
    present = list(dict.fromkeys(c for _, row in numbered for c in row))
    wanted, sources = _choose_columns(present, dataset, trainer, layout, columns)
    labels = {c: f"'{sources[c]}'" + (f" (as '{c}')" if sources[c] != c else "") for c in wanted}
    out = []
    for i, row in numbered:
        try:
            out.append(_shape(row, wanted, sources, labels))
        except BadRow as bad:
            sieve.reject(where(i), bad)
    sieve.close()
    if not out:
        raise sieve.none_left(what)
    return Prepared(out, sieve.dropped)


def _locator(origin, split: str, n_rows: int):
    if origin is None:
        return lambda i: f"{split} split row {i}"
    if isinstance(origin, (str, Path)):
        return lambda i: f"{origin} line {i + 1}"
    numbers = origin.get("lines", origin.get("rows"))
    if numbers is None or len(numbers) != n_rows:
        raise ValueError(f"origin lists {len(numbers or [])} {split} rows, but there are {n_rows}")
    if "lines" in origin:
        return lambda i: f"{origin['file']} line {numbers[i]}"
    source = origin["file"] if "file" in origin else f"{origin['hub']} split '{origin['split']}'"
    return lambda i: f"{source} row {numbers[i]}"


def _after_format(where, format: str):
    return lambda i: f"{where(i)}, after format '{format}'"


def _convert(numbered: list, format: str, dataset: str, sieve: _Sieve, where) -> list:
    convert, needs = FORMATS[format]
    present = list(dict.fromkeys(c for _, row in numbered for c in row))
    missing = [c for c in needs if c not in present]
    if missing:
        raise DataError(f"dataset '{dataset}': format '{format}' needs column '{missing[0]}'; "
                        f"columns are {present}")
    out = []
    for i, row in numbered:
        try:
            out.append((i, convert(row)))
        except BadRow as bad:
            sieve.reject(where(i), bad)
    return out


def _choose_columns(present: list[str], dataset: str, trainer: str, layout: str, columns: dict[str, str]):
    """The layout alternative the dataset's columns (after the user's mapping) provide, and each one's source."""
    # Mapping: expected name -> source name. A mapped source must exist.
    for target, source in columns.items():
        if source not in present:
            raise DataError(f"dataset '{dataset}': column mapping {target} -> '{source}': no column '{source}'; "
                            f"columns are {present}")
    renamed = {c: c for c in present} | columns  # expected name -> source column
    for wanted in LAYOUTS[layout]:
        if all(c in renamed for c in wanted):
            return wanted, {c: renamed[c] for c in wanted}
    options = " or ".join("(" + ", ".join(w) + ")" for w in LAYOUTS[layout])
    missing = next(c for c in LAYOUTS[layout][0] if c not in renamed)
    raise DataError(f"dataset '{dataset}': trainer '{trainer}' needs columns {options}; missing '{missing}'; "
                    f"columns are {present} (map names with datasets.{dataset}.columns)")


def preprocess_splits(inputs, outputs, *, dataset: str, trainer: str, layout: str, columns: dict,
                      format: str | None, bad_rows: str) -> dict:
    """The preprocess rule: both splits checked before either is written, then a summary of what was kept
    and dropped (fetching's malformed lines included) for the log and the report."""
    from snaketrl.io import read_json, write_json

    origin = read_json(inputs["origin"])
    got = {split: preprocess(read_jsonl(inputs[split]), dataset=dataset, trainer=trainer, layout=layout,
                             columns=columns, split=split, format=format, origin=origin[split], bad_rows=bad_rows)
           for split in ("train", "eval")}
    summary = {"fetch": origin.get("dropped", {"count": 0})}
    for split, prepared in got.items():
        write_jsonl(prepared.rows, outputs[split])
        summary[split] = {"rows": len(prepared.rows), "dropped": prepared.dropped.count,
                          "reasons": prepared.dropped.to_json()["reasons"]}
        print(f"{split}: {len(prepared.rows)} rows kept, {prepared.dropped.count} dropped; columns "
              f"{list(prepared.rows[0])}")
    write_json(summary, outputs["summary"])
    return summary
