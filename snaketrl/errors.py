"""The one place errors come from: every error a user should read as one line is a SnaketrlError.

Rule scripts catch these (snaketrl.smk.logged) and print `snaketrl: <message>`; anything else is a bug
and keeps its traceback in the rule's log.
"""

import difflib


class SnaketrlError(Exception):
    """An error in the user's input (config, data, environment), worded for the user."""


class ConfigError(SnaketrlError, ValueError):
    pass


class DataError(SnaketrlError, ValueError):
    pass


class HubUnreachable(SnaketrlError, RuntimeError):
    pass


class DiskFull(SnaketrlError, OSError):
    """A save that ran out of space; the message names the path and the space it needed."""


def did_you_mean(name: str, known) -> str:
    """`; did you mean 'x'?` for the closest of `known`, or "" when none is close: the hint every
    "unknown name" message ends with."""
    match = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean '{match[0]}'?" if match else ""


def close_match(name: str, known) -> str:
    """` (did you mean 'x'?)` for the closest of `known`, or "": for messages that go on after the name."""
    hint = did_you_mean(name, known)
    return f" ({hint[2:]})" if hint else ""
