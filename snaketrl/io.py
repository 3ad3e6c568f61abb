"""Outputs that appear whole or not at all: written under a temporary name, renamed when complete.

A step that fails half-way leaves nothing a later step (or a rerun's resume) would trust, and no moment where
an output is lost:
- A file is replaced by one rename (os.replace): a reader sees the old file or the new one.
- A directory cannot be renamed over a non-empty one: the old one is renamed aside (`.<name>.replaced`), the new
  one renamed in, then the old one deleted. A kill between the two renames leaves only the aside copy: the next
  write of that output (`recover`) renames it back, so the old output is there until a new one replaces it; a
  kill after the second finds both, and the aside copy goes.
- Temporary names are `.<stem>.tmp<tag or pid><suffix>` beside the output: the next write of the same output
  removes any a killed writer left (each attempt has a new pid, and a real model's leftover is gigabytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path


def _temporary(path: Path, tag: str) -> Path:
    # The suffix stays last: matplotlib and others choose the format from it.
    return path.with_name(f".{path.stem}.tmp{tag}{path.suffix}")


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.stem}.replaced{path.suffix}")


def leftovers(path) -> list[Path]:
    """The temporary copies of `path` that writers cut short left beside it (none of another output's)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    # A tag has no dot, so `.model.tmp1.json` (model.json's) is not `model`'s.
    own = re.compile(rf"\.{re.escape(path.stem)}\.tmp[^./]*{re.escape(path.suffix)}")
    return sorted(p for p in path.parent.iterdir() if own.fullmatch(p.name))


def recover(path) -> None:
    """Settle what a kill during `path`'s last write left: an old directory set aside and never replaced goes
    back in place (a new one that made it in wins, and the old one goes); temporary copies are removed."""
    path = Path(path)
    aside = _aside(path)
    if aside.exists() or aside.is_symlink():
        if path.exists() or path.is_symlink():
            _remove(aside)
        else:
            os.replace(aside, path)
    for tmp in leftovers(path):
        _remove(tmp)


@contextmanager
def atomic(path, directory: bool = False, tag: str | None = None):
    """Yield a temporary path beside `path` (a file, or a directory if `directory`); on success it
    replaces `path`, on failure it is removed. `tag` (no dot) names the temporary path instead of this
    process's id (processes that write into one, each knowing its name)."""
    path = Path(path)
    tag = str(os.getpid() if tag is None else tag)
    if "." in tag or "/" in tag:
        raise ValueError(f"atomic({path}): tag {tag!r} has a dot or a slash")
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = _temporary(path, tag)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        _replace(tmp, path)
    finally:
        _remove(tmp)


def _replace(new: Path, path: Path) -> None:
    old_dir = path.is_dir() and not path.is_symlink()
    if not (old_dir or (new.is_dir() and (path.exists() or path.is_symlink()))):
        os.replace(new, path)  # one step: a file over a file (or over nothing)
        return
    aside = _aside(path)
    os.replace(path, aside)
    os.replace(new, path)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _not_json(obj, where: str = "") -> tuple[str, object] | None:
    """The first value json.dumps (without a `default`) cannot write: (its key path, the value); None if none."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{where}[{key!r}] (a key)", key
            found = _not_json(value, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found = _not_json(value, f"{where}[{i}]")
            if found:
                return found
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return None
    return where or "the value", obj


def dumps(obj, path, **kwargs) -> str:
    """json.dumps for an output file: a value that is not JSON is an error naming its key path (never turned into
    a string a later step would read as the value)."""
    try:
        return json.dumps(obj, **kwargs)
    except (TypeError, ValueError) as err:
        found = _not_json(obj)
        if found is None:
            raise
        where, value = found
        raise TypeError(f"{path}: {where} is a {type(value).__name__} ({value!r}), which JSON cannot hold") from err


def write_json(obj, path) -> None:
    text = dumps(obj, path, indent=2)
    with atomic(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _feed(h, path: Path) -> None:
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)


def file_sha256(path) -> str:
    h = hashlib.sha256()
    _feed(h, Path(path))
    return h.hexdigest()


def hash_path(path) -> str:
    """sha256 of a file, or of a directory's files (names and contents, in sorted order)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        _feed(h, f)
    return h.hexdigest()


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a file this workflow wrote (user files go through `fetch`)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written file."""
    text = "".join(dumps(row, f"{path} row {i}", ensure_ascii=False) + "\n" for i, row in enumerate(rows, 1))
    with atomic(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
