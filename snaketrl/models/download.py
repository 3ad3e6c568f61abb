"""Base models from elsewhere: a Hub snapshot of what training needs (or a local directory copied with the same
filter), or a GGUF file turned into an HF directory (snaketrl.models.gguf); given a chat template where the config
names one (snaketrl.models.chat_template).
"""

from __future__ import annotations

import os
from pathlib import Path

# What training needs: configs, tokenizer files and safetensors weights (no .bin, no optimizer states).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


def download(name: str, entry: dict, out_dir: str | Path, gguf_paths: list[str] | None = None,
             template_source: str | None = None) -> None:
    """The model directory of a hub or gguf entry (`gguf_paths`: its local GGUF file, or parts), with the chat
    template models.<name>.chat_template names (`template_source`: its local file or directory as the job reads
    it) applied before the directory is in place."""
    if "chat_template" not in entry:
        fetch(name, entry, out_dir, gguf_paths)
        return
    from snaketrl.io import atomic

    with atomic(out_dir, directory=True) as tmp:
        fetch(name, entry, tmp, gguf_paths)
        give_template(name, entry, tmp, template_source)


def give_template(name: str, entry: dict, model_dir: Path, source: str | None) -> None:
    """The model in `model_dir` saved again with its chat template (and embeddings grown for the tokens it adds),
    and the record of what was added (chat_template.RECORD_FILE)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketrl.models.chat_template import apply, write_record

    trust = entry.get("trust_remote_code", False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", trust_remote_code=trust)
    record = apply(name, entry["chat_template"], model, tokenizer, source)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    write_record(record, model_dir)
    print(json.dumps(record, indent=2))


def fetch(name: str, entry: dict, out_dir: str | Path, gguf_paths: list[str] | None = None) -> None:
    """snapshot_download of only what training needs; a local directory (pre-downloaded, or a test's
    fake hub) is copied with the same filter. A `gguf` entry is converted (`gguf_paths`: its local files)."""
    import fnmatch
    import shutil

    from snaketrl import hub

    if "gguf" in entry:
        from snaketrl.models.gguf import convert

        convert(name, entry["gguf"], out_dir, gguf_paths)
        return

    repo, out_dir = os.path.expanduser(entry["hub"]), Path(out_dir)  # `~/models/x`: a local directory
    patterns = HUB_PATTERNS if entry.get("trust_remote_code") else [p for p in HUB_PATTERNS if p != "*.py"]
    if Path(repo).is_dir():
        for src in sorted(Path(repo).rglob("*")):
            rel = src.relative_to(repo)
            if src.is_file() and not rel.parts[0].startswith(".") and any(
                    fnmatch.fnmatch(rel.name, p) for p in patterns):
                (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out_dir / rel)
    else:
        from huggingface_hub import snapshot_download

        prefetch = (f"`hf download {repo} --local-dir DIR` (revision {entry.get('revision', 'main')}), copy DIR "
                    f"here and set models.{name}.hub to DIR")
        hub.require("model", name, repo, prefetch)
        snapshot_download(repo, revision=entry.get("revision", "main"), local_dir=out_dir, allow_patterns=patterns)
    if not any(out_dir.glob("*.safetensors")) and not any(out_dir.glob("*/*.safetensors")):
        raise RuntimeError(f"model '{name}': '{repo}' has no safetensors weights; this workflow loads only "
                           f"safetensors (convert the checkpoint first)")
