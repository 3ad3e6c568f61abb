"""The one place errors come from: every error a user should read as one line is a SnaketrlError.

Rule scripts catch these (snaketrl.smk.logged) and print `snaketrl: <message>`; anything else is a bug
and keeps its traceback in the rule's log.
"""

import difflib
import re


class SnaketrlError(Exception):
    """An error in the user's input (config, data, environment), worded for the user."""


class ConfigError(SnaketrlError, ValueError):
    pass


class DataError(SnaketrlError, ValueError):
    pass


class HubUnreachable(SnaketrlError, RuntimeError):
    pass


class TrainingError(SnaketrlError, RuntimeError):
    """A training job that ended without a result worth keeping (no optimizer step)."""


class DiskFull(SnaketrlError, OSError):
    """A save that ran out of space; the message names the path and the space it needed."""


def closest(name: str, known) -> str | None:
    """The closest of `known` to `name`, or None when none is close: the first (in `known`'s order) holding
    `name` as a whole word (`adamw` -> adamw_torch, `alpha` -> lora_alpha, not the more similar grokadamw or
    alpha_pattern), else the most similar."""
    known = list(known)
    if len(name) >= 3:
        word = re.compile(rf"(^|[_.-]){re.escape(name)}($|[_.-])")
        match = next((k for k in known if word.search(k)), None)
        if match:
            return match
    match = difflib.get_close_matches(name, known, n=1)
    return match[0] if match else None


def did_you_mean(name: str, known) -> str:
    """`; did you mean 'x'?` for the closest of `known`, or "" when none is close: the hint every
    "unknown name" message ends with."""
    match = closest(name, known)
    return f"; did you mean '{match}'?" if match else ""


def close_match(name: str, known) -> str:
    """` (did you mean 'x'?)` for the closest of `known`, or "": for messages that go on after the name."""
    hint = did_you_mean(name, known)
    return f" ({hint[2:]})" if hint else ""


def one_line(text: str, limit: int | None = None) -> str:
    """A message as the console shows it: one line, cut to `limit` characters."""
    text = re.sub(r"\s*\n\s*", " ", text.strip())
    return text[: limit - 3] + "..." if limit and len(text) > limit else text
