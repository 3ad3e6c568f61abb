"""What a row must hold, and how a bad one is reported.

A bad row is named by where the user can find it: their file and line (or a Hub split and row index), its
column, and what was expected there. Under `bad_rows: drop` bad rows are left out and counted instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from snaketrl.errors import ConfigError, DataError

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


class Sieve:
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


MISSING = object()


def describe(value) -> str:
    if value is MISSING:
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
        return describe(value)
    return repr(value if len(value) <= 40 else value[:40] + "...")


def non_empty_text(value) -> None:
    if not (isinstance(value, str) and value.strip()):
        raise BadRow(f"expected a non-empty string, got {describe(value)}")


CONVERSATION = "a non-empty list of {role, content} messages"


def _conversation(value) -> None:
    if not (isinstance(value, list) and value):
        raise BadRow(f"expected {CONVERSATION}, got {describe(value)}")
    for n, message in enumerate(value, 1):
        try:
            _message(message)
        except BadRow as bad:
            raise BadRow(f"message {n}: {bad}") from None


def _message(message) -> None:
    if not isinstance(message, dict):
        raise BadRow(f"expected an object with 'role' and 'content', got {describe(message)}")
    if "role" not in message or "content" not in message:
        keys = ", ".join(map(repr, message)) or "none"
        raise BadRow(f"expected keys 'role' and 'content', got keys {keys}")
    if message["role"] not in ROLES:
        raise BadRow(f"expected a role among {', '.join(ROLES)}, got {_quote(message['role'])}")
    content = message["content"]
    # An empty system message is a common export artefact and harmless; an empty turn is not.
    if not (isinstance(content, str) and (content.strip() or message["role"] == "system")):
        raise BadRow(f"content: expected a non-empty string, got {describe(content)}")


def _kind(value) -> str | None:
    return "string" if isinstance(value, str) else "conversation" if isinstance(value, list) else None


def in_column(label: str, check, value) -> None:
    try:
        check(value)
    except BadRow as bad:
        raise BadRow(f"column {label}: {bad}") from None


def check_texts(values: dict, labels: dict) -> None:
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
                         f"got {describe(value)}")
        in_column(labels[column], non_empty_text if kinds[first] == "string" else _conversation, value)


TEXT_COLUMNS = ("prompt", "completion", "chosen", "rejected")


CHECKS = {"messages": _conversation, "text": non_empty_text, "answer": non_empty_text}
