"""Numbers as people read them, the same in log lines, errors and the report."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """512 bytes, 12.5 KiB, 512 MiB, 2.50 GiB: a size to the precision a reader compares."""
    if n < 1024:
        return f"{n:.0f} bytes"
    if n < 2**20:
        return f"{n / 1024:.1f} KiB"
    mib = n / 2**20
    return f"{mib / 1024:,.2f} GiB" if mib >= 1024 else f"{mib:,.0f} MiB"
