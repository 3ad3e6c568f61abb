"""Outputs that appear whole or not at all: written under a temporary name, renamed when complete.

A step that fails half-way leaves nothing a later step (or a rerun's resume) would trust.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic(path, directory: bool = False, tag: str | None = None):
    """Yield a temporary path beside `path` (a file, or a directory if `directory`); on success it
    replaces `path`, on failure it is removed. `tag` names the temporary path instead of this process's id
    (processes that write into one, each knowing its name)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The suffix stays last: matplotlib and others choose the format from it.
    tmp = path.with_name(f".{path.stem}.tmp{tag or os.getpid()}{path.suffix}")
    _remove(tmp)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        _remove(path)
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_json(obj, path) -> None:
    with atomic(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")


def read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def hash_path(path) -> str:
    """sha256 of a file, or of a directory's files (names and contents, in sorted order)."""
    import hashlib

    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()

def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a file this workflow wrote (user files go through `fetch`)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written file."""
    from snaketrl.io import atomic

    with atomic(path) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
