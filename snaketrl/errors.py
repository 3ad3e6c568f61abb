"""The one place errors come from: every error a user should read as one line is a SnaketrlError.

Rule scripts catch these (snaketrl.smk.logged) and print `snaketrl: <message>`; anything else is a bug
and keeps its traceback in the rule's log.
"""


class SnaketrlError(Exception):
    """An error in the user's input (config, data, environment), worded for the user."""


class ConfigError(SnaketrlError, ValueError):
    pass


class DataError(SnaketrlError, ValueError):
    pass


class HubUnreachable(SnaketrlError, RuntimeError):
    pass
