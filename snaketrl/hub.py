"""Hub access: fail at once, naming what to pre-fetch, when the Hub cannot be reached.

The token, if any, is huggingface_hub's own business: it reads HF_TOKEN from the environment.
Nothing here reads, passes or logs it.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from snaketrl.errors import HubUnreachable


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(endpoint())
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def require(kind: str, name: str, repo: str, prefetch: str) -> None:
    """Raise before a download would retry for minutes against an unreachable Hub."""
    if not reachable():
        raise HubUnreachable(
            f"{kind} '{name}': cannot reach the Hugging Face Hub ({endpoint()}) to fetch '{repo}'. "
            f"On a machine with internet: {prefetch}")
