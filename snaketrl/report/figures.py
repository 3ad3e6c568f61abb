"""What every report section uses: embedded PNGs and values read from a log history.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path


def data_uri(png_path_or_bytes) -> str:
    raw = png_path_or_bytes if isinstance(png_path_or_bytes, bytes) else Path(png_path_or_bytes).read_bytes()
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def last_value(history: list[dict], key: str):
    """The last logged value of `key` (the final summary entry holds train_* keys, not curves)."""
    for entry in reversed(history):
        if key in entry:
            return entry[key]
    return None


def first_value(history: list[dict], key: str):
    return last_value(history[::-1], key)


def pyplot():
    """matplotlib's pyplot without a display, its tick labels in positional notation like the page's numbers
    (no 1e-5 ticks, no +1e3 offsets; log axes keep their powers of ten)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"axes.formatter.limits": (-99, 99), "axes.formatter.useoffset": False})
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
