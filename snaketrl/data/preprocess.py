"""Per-trainer preprocessing: a dataset's rows mapped to the columns its trainer's layout expects, every
row checked, both splits checked before either is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from snaketrl.data.formats import FORMATS, split_prompt
from snaketrl.data.schema import CHECKS, MISSING, TEXT_COLUMNS, BadRow, Dropped, Sieve, check_texts, describe, in_column
from snaketrl.errors import DataError
from snaketrl.io import read_json, read_jsonl, write_json, write_jsonl

# Columns each trainer family consumes, as alternatives (first match wins).
LAYOUTS: dict[str, list[tuple[str, ...]]] = {
    "language_modeling": [("prompt", "completion"), ("messages",), ("text",)],
    "preference": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
    # Online trainers pass extra columns to reward functions: keep a gsm8k-style `answer`.
    "prompt": [("prompt", "answer"), ("prompt",)],
}


@dataclass(frozen=True)
class Prepared:
    rows: list[dict]
    dropped: Dropped


def _shape(row: dict, wanted: tuple[str, ...], sources: dict[str, str], labels: dict[str, str]) -> dict:
    """One output row, checked: its columns in `wanted`, renamed from their `sources`."""
    out = {c: row.get(sources[c], MISSING) for c in wanted}
    texts = {c: out[c] for c in wanted if c in TEXT_COLUMNS}
    if texts:
        check_texts(texts, labels)
    for column in wanted:
        if column in CHECKS:
            in_column(labels[column], CHECKS[column], out[column])
    if "chosen" in out and "prompt" not in out:
        out = _implicit_prompt(out, labels)
    return out


def _implicit_prompt(row: dict, labels: dict) -> dict:
    prompt, chosen, rejected = split_prompt(row["chosen"], row["rejected"])
    if not (prompt.strip() if isinstance(prompt, str) else prompt):
        raise BadRow(f"columns {labels['chosen']} and {labels['rejected']}: expected a shared beginning (the prompt, "
                     f"as there is no 'prompt' column), got none")
    for column, rest, other in (("chosen", chosen, "rejected"), ("rejected", rejected, "chosen")):
        if isinstance(rest, str) and not rest.strip():
            raise BadRow(f"column {labels[column]}: expected a non-empty string after the prompt it shares with "
                         f"{labels[other]}, got {describe(rest)}")
        if not rest:
            raise BadRow(f"column {labels[column]}: expected messages after the prompt it shares with "
                         f"{labels[other]}, got none")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


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
    sieve = Sieve(dataset, bad_rows)
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


def _convert(numbered: list, format: str, dataset: str, sieve: Sieve, where) -> list:
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
