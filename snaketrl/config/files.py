"""The local files a config names: the datasets' files, a tiny model's corpus, a GGUF source; `workflow:<path>`
names one shipped with the workflow (paths.from_config).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from snaketrl import paths
from snaketrl.errors import ConfigError


def corpus_files(config: dict, model: str, shipped: Callable[[str], str] | None = None) -> list[str]:
    """The files a tiny model's tokenizer and pretraining read. A corpus entry that names a dataset of the
    config stands for its train split as fetched: its eval rows (the evaluation's prompts and references)
    never reach pretraining. Any other entry is a local .jsonl/.txt file (`workflow:<path>`: one shipped with
    the workflow, found by `shipped`; see paths.from_config)."""
    out = []
    for item in config["models"][model]["tiny"]["corpus"]:
        if item in config["datasets"]:
            out.append(paths.raw(item, "train"))
        elif Path(paths.from_config(item, shipped)).is_file():
            out.append(paths.from_config(item, shipped))
        else:
            raise ConfigError(f"config: models.{model}.tiny.corpus: '{item}' is neither a dataset of this config "
                              f"({', '.join(sorted(config['datasets']))}) nor an existing .jsonl/.txt file"
                              f"{where_looked(item, shipped)}")
    return out


def local_files(entry: dict, shipped: Callable[[str], str] | None = None) -> dict[str, str]:
    """split -> the local file of a dataset entry that the get_dataset job reads (none for a Hub dataset);
    `workflow:<path>` resolved by `shipped` (paths.from_config)."""
    return {split: paths.from_config(path, shipped) for split, path in written_files(entry).items()}


def written_files(entry: dict) -> dict[str, str]:
    """split -> a dataset entry's local file as written in the config."""
    files = entry.get("files")
    if files is None:
        return {}
    return dict(files) if isinstance(files, dict) else {"train": files}


def where_looked(path: str, shipped) -> str:
    """Where a missing file was looked for, and the fix when the workflow ships it: a config copied from the
    default, or written for a run inside the clone, names the samples relative to the clone."""
    if path.startswith(paths.SHIPPED_PREFIX):
        return f" in the workflow ({paths.from_config(path, shipped)})" if shipped else ""
    if os.path.isabs(path) or shipped is None:
        return ""
    hint = f" (relative paths are read from the working directory, {os.getcwd()}"
    if Path(shipped(path)).is_file():
        return f"{hint}; the workflow ships {path}: write {paths.SHIPPED_PREFIX}{path})"
    return hint + ")"


def gguf_file(entry: dict, shipped: Callable[[str], str] | None = None) -> dict[str, str | list[str]]:
    """{"gguf": file} of a model converted from a local GGUF file, {"gguf": [part, ...]} from the parts of one (the
    download job's inputs), else {}."""
    path = entry.get("gguf", {}).get("path")
    if isinstance(path, list):
        return {"gguf": [paths.from_config(part, shipped) for part in path]}
    return {"gguf": paths.from_config(path, shipped)} if path else {}


def chat_template_file(entry: dict, shipped: Callable[[str], str] | None = None) -> dict[str, str]:
    """{"chat_template": path} of a model given a chat template from a local Jinja file or tokenizer directory (the
    download job's input: its edit gives the model its template again), else {}."""
    from snaketrl.models.chat_template import kind

    value = entry.get("chat_template")
    if value is None or kind(value) not in ("file", "local"):
        return {}
    return {"chat_template": os.path.expanduser(paths.from_config(value, shipped))}
