"""Every number of the report as a person reads it, and the tables that hold them.

One rule for the whole page: no e-notation (a learning rate of 5e-3 reads 0.005), thousands separators on
counts, k/M/G/T on counts that span decades (FLOPs), shares as percentages, and one number of decimals per
table column. Tables are data here (`table`) and markup in templates/table.html.j2, so every name and value
from a config is escaped by Jinja like the rest of the page.
"""

from __future__ import annotations

import json
import math

import numpy as np

from snaketrl.units import human_bytes

MISSING = "–"
MINUS = "\u2212"  # the typographic minus, as wide as "+"
SI = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
# Column kinds: "text", "int" (thousands separators), "float" (the column's decimals), "percent" (a share
# 0..1 shown ×100), "si" (k/M/G/T, three significant digits), "bytes" (MiB/GiB), "seconds".
KINDS = ("text", "int", "float", "percent", "si", "bytes", "seconds")


def _real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def plain(value) -> str:
    """A float in positional notation with all its digits (repr's shortest round trip, never e-notation)."""
    if not _real(value):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if not math.isfinite(value):
        return "∞" if value > 0 else ("-∞" if value < 0 else "NaN")
    return np.format_float_positional(float(value), trim="-")


def decimals_for(values, significant: int = 3, most: int = 6) -> int:
    """Decimals that give the column's largest magnitude `significant` digits (0 for values ≥ 10^(significant-1)),
    at most `most`: one number of decimals for a whole column."""
    finite = [abs(float(v)) for v in values if _real(v) and math.isfinite(v) and v != 0]
    if not finite:
        return 0
    return int(min(most, max(0, significant - 1 - math.floor(math.log10(max(finite))))))


def si(value, significant: int = 3) -> str:
    """1234567 -> "1.23 M"; below 1000 the number itself."""
    for scale, prefix in SI:
        if abs(value) >= scale:
            scaled = value / scale
            digits = max(0, significant - 1 - math.floor(math.log10(abs(scaled))))
            return f"{scaled:.{digits}f} {prefix}"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.{decimals_for([value])}f}"


def number(value, kind: str = "float", decimals: int | None = None) -> str:
    """One value as its column kind shows it; missing values (None, NaN) read "–", a negative one "−"."""
    if value is None or (_real(value) and isinstance(value, (float, np.floating)) and math.isnan(value)):
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if not _real(value):
        return str(value)
    if kind == "text":
        return plain(value)  # a config's value as written (a swept value reads as in its run's name)
    return with_sign(value, _magnitude(abs(value), kind, decimals))


def with_sign(value, text: str, plus: bool = False) -> str:
    """`text`, the magnitude of `value` as shown, with its sign: "−" (the typographic minus, as every negative
    number on the page) where negative, "+" where positive and `plus`; none where the text shows zero ("0.000"),
    while "<0.001" (a value at float noise off zero) keeps its sign."""
    if not any(c in "123456789∞" for c in text):
        return text
    return (MINUS if value < 0 else "+" if plus else "") + text


def _magnitude(value, kind: str, decimals: int | None) -> str:
    """A value ≥ 0 (or +∞) as its column kind shows it."""
    if not math.isfinite(value):
        return plain(value)
    if kind == "int":
        return f"{round(value):,}"
    if kind == "percent":
        return _fixed(100 * value, 1 if decimals is None else decimals) + "%"
    if kind == "si":
        return si(value)
    if kind == "bytes":
        return human_bytes(value)
    if kind == "seconds":
        return f"{value:,.1f} s" if value < 600 else f"{int(value // 60)} min {value % 60:02.0f} s"
    if decimals is not None:
        return _fixed(value, decimals)
    if value >= 1000:
        return f"{value:,.0f}"
    # One value on its own: four significant digits, trailing zeros dropped (a learning rate reads 0.005).
    return np.format_float_positional(float(value), precision=4, unique=False, fractional=False, trim="-")


def _fixed(value, decimals: int) -> str:
    """A value ≥ 0 with `decimals` decimals; one that is not zero but would read as zero says so (<0.001)."""
    if value and value < 0.5 * 10 ** -decimals:
        return f"<{10 ** -decimals:.{decimals}f}"
    return f"{value:,.{decimals}f}"


def spread(value, kind: str, decimals: int | None) -> str:
    """A ± spread in the mean's unit: percentage points for a share."""
    if kind == "percent":
        return f"{100 * value:.{1 if decimals is None else decimals}f}"
    return number(value, kind, decimals)


def pretty_json(obj) -> str:
    """json.dumps(indent=2) with floats in positional notation (json writes 5e-05)."""
    floats = []

    def swap(x):
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [swap(v) for v in x]
        if isinstance(x, float) and math.isfinite(x):  # json writes NaN and Infinity itself
            floats.append(plain(x))
            return f"\0{len(floats) - 1}\0"
        return x

    text = json.dumps(swap(obj), indent=2)
    for i, value in enumerate(floats):
        text = text.replace(json.dumps(f"\0{i}\0"), value, 1)
    return text


def cell(text: str, sort=None, *, cls: str = "", mark: str = "", bold: bool = False, title: str = "") -> dict:
    """A table cell: the text shown, the value a click on its header sorts by (a number, else the text)."""
    return {"text": text, "sort": "" if sort is None or (_real(sort) and not math.isfinite(sort)) else sort,
            "cls": cls, "mark": mark, "bold": bold, "title": title}


def column(name: str, kind: str = "text", *, secondary: bool = False, title: str = "", decimals: int | None = None,
           label: str | None = None) -> dict:
    """A table column: `secondary` ones are folded away until the reader asks for every column."""
    if kind not in KINDS:
        raise ValueError(f"column {name!r}: kind {kind!r} is not one of {KINDS}")
    # Headers break after underscores (zero-width space) rather than widening the table.
    return {"name": name, "label": (label or name).replace("_", "_\u200b"), "kind": kind, "secondary": secondary,
            "title": title, "decimals": decimals}


def table(columns: list[dict], rows: list[list], *, cls: str = "", caption: str = "") -> dict:
    """A table for templates/table.html.j2: each row a list of raw values (formatted by their column: a float
    column gets one number of decimals from its values) or cells (`cell`). The first column is the row's name."""
    for i, col in enumerate(columns):
        if col["kind"] == "float" and col["decimals"] is None:
            col["decimals"] = decimals_for([row[i] for row in rows if not isinstance(row[i], dict)])
    body = [[value if isinstance(value, dict) else cell(number(value, col["kind"], col["decimals"]),
                                                        value if _real(value) or value is None else str(value))
             for col, value in zip(columns, row)] for row in rows]
    return {"columns": columns, "rows": body, "cls": cls, "caption": caption,
            "folded": any(c["secondary"] for c in columns)}
