"""A chat template for a model whose tokenizer has none (models.<name>.chat_template): a named template, a Jinja
file, or another model's tokenizer (TRL's clone_chat_template). The download_model job applies it once, so every
later stage (the length histogram, each trainer, the evaluation) reads the same template from the model directory.

A template whose markers the tokenizer lacks gets them as special tokens, with embedding rows for them; the train
job makes those rows trainable (`trainable_tokens`), and the model directory records what was added (RECORD_FILE,
which each run's manifest copies). The parse-time part (`kind`, `check`) is pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from snaketrl.errors import ConfigError, close_match

# Written into the model directory: the train job reads the added tokens from it, the manifest copies it.
RECORD_FILE = "chat_template.json"
# What a named template writes into a model directory, as a number the download job's params carry: bump it when
# NAMED or `apply` changes the rendered turns, so models built before the change are built again. 2: a template
# writes bos where the tokenizer opens every text with it (Gemma 3 reads noise without).
REVISION = 2
FILE_SUFFIXES = (".jinja", ".j2")
LOCAL_PREFIXES = ("/", "./", "../", "~", "workflow:")


@dataclass(frozen=True)
class Named:
    """A template the workflow knows by name: its Jinja text (or TRL's shipped file of that name), the markers it
    needs as special tokens, and the token that ends a turn (generation stops there: the new eos)."""
    text: str | None
    tokens: tuple[str, ...]
    eos: str | None
    trl_file: str | None = None
    bos: str | None = None  # added as bos where the tokenizer has none (the template writes bos_token)


# ChatML, the template of the Qwen2.5 instruct models: `<|im_end|>` closes every turn.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Zephyr's: each turn ends with the tokenizer's own eos.
ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
NAMED = {
    "chatml": Named(CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    # TRL's own copy of Llama 3's template: TRL recognises it (its training variant for assistant_only_loss).
    "llama3": Named(None, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>",
                    trl_file="llama3.jinja", bos="<|begin_of_text|>"),
    "zephyr": Named(ZEPHYR, ("<|system|>", "<|user|>", "<|assistant|>"), None),
}
EXPECTED = (f"a template name ({', '.join(sorted(NAMED))}), a .jinja file, or another model's tokenizer (a local "
            f"directory, or a Hub id org/name)")


def kind(value: str) -> str | None:
    """`named`, `file` (a Jinja file), `local` (a directory holding a tokenizer) or `hub` (a Hub id whose tokenizer
    is cloned); None for a bare word that is no known name."""
    if value in NAMED:
        return "named"
    if value.endswith(FILE_SUFFIXES):
        return "file"
    if value.startswith(LOCAL_PREFIXES):
        return "local"
    return "hub" if "/" in value else None


def check(name: str, entry: dict) -> None:
    """models.<name>.chat_template at parse time: a known kind, and a model whose tokenizer is fetched (a tiny
    model's ships ChatML already)."""
    value = entry.get("chat_template")
    if value is None:
        return
    where = f"config: models.{name}.chat_template"
    if kind(value) is None:
        raise ConfigError(f"{where}: unknown template '{value}'{close_match(value, NAMED)}; expected {EXPECTED}")
    if "tiny" in entry:
        raise ConfigError(f"{where}: a tiny model's tokenizer ships a ChatML template already; chat_template is for "
                          f"hub and gguf models")


def apply(name: str, value: str, model, tokenizer, source: str | None = None) -> dict:
    """Give `tokenizer` the template `value` (models.<name>.chat_template; `source`: its local file or directory
    as the job reads it), with the special tokens it needs and `model`'s embeddings grown for them. Returns the
    record: the template as configured, the tokens added (token -> id), eos, and the vocabulary before and after."""
    import torch

    before, old_eos = len(tokenizer), tokenizer.eos_token
    how = kind(value)
    if how in ("local", "hub"):
        added = clone(name, value, model, tokenizer, source)
    else:
        if how == "file":
            tokenizer.chat_template = Path(source or value).read_text(encoding="utf-8")
            named = Named(None, (), None)
        else:
            named = NAMED[value]
            tokenizer.chat_template = named.text if named.text is not None else trl_template(named.trl_file)
            if named.text is not None and opens_with_bos(tokenizer):
                # The model read bos first in every pretraining text (Gemma's greedy answer without it is noise);
                # TRL tokenizes a rendered chat without special tokens, so the template writes it.
                tokenizer.chat_template = "{{ bos_token }}" + named.text
        vocab = tokenizer.get_vocab()
        if named.bos and tokenizer.bos_token is None:
            tokenizer.add_special_tokens({"bos_token": named.bos})
        missing = [t for t in named.tokens if t not in vocab]
        if missing:
            tokenizer.add_tokens(missing, special_tokens=True)
        if named.eos:
            tokenizer.eos_token = named.eos
        elif how == "named" and tokenizer.eos_token is None:
            raise ConfigError(f"config: models.{name}.chat_template: {value} ends each turn with the tokenizer's eos "
                              f"token, and this model's tokenizer has none; use chatml or llama3")
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            torch.manual_seed(0)  # the new rows start from the old ones' mean plus noise: the same in every build
            model.resize_token_embeddings(len(tokenizer))
        added = [t for t in tokenizer.get_vocab() if t not in vocab]
    model.config.eos_token_id = tokenizer.eos_token_id
    if model.can_generate():
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        model.config.bos_token_id = tokenizer.bos_token_id
    ids = tokenizer.convert_tokens_to_ids(added)
    return {"chat_template": value, "added_tokens": dict(sorted(zip(added, ids), key=lambda item: item[1])),
            "eos_token": tokenizer.eos_token, **({"replaced_eos_token": old_eos} if old_eos != tokenizer.eos_token
                                                else {}),
            "vocab_size": [before, len(tokenizer)]}


def opens_with_bos(tokenizer) -> bool:
    """Whether the tokenizer starts a plain text with its bos token (Gemma's and Llama's do, GPT-2's does not)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def trl_template(file: str) -> str:
    from importlib.resources import files

    return (files("trl") / "chat_templates" / file).read_text(encoding="utf-8")


def clone(name: str, value: str, model, tokenizer, source: str | None) -> list[str]:
    """TRL's clone_chat_template: the template, the added tokens and eos of another model's tokenizer (a local
    directory; a Hub id where the Hub is reachable, else the error names what to pre-download). Returns the
    tokens added."""
    import os

    from trl import clone_chat_template

    from snaketrl import hub

    path = os.path.expanduser(source or value)
    where = f"config: models.{name}.chat_template"
    if kind(value) == "hub":
        hub.require("model", name, value, f"`hf download {value} --include 'tokenizer*' 'special_tokens_map.json' "
                                          f"'chat_template.jinja' --local-dir DIR`, copy DIR here and set "
                                          f"models.{name}.chat_template to DIR")
    elif not Path(path).is_dir():
        raise ConfigError(f"{where}: {path} is not a directory holding a tokenizer")
    from transformers import AutoTokenizer

    if not AutoTokenizer.from_pretrained(path).chat_template:
        raise ConfigError(f"{where}: the tokenizer in {path} has no chat template to copy")
    vocab = tokenizer.get_vocab()
    # No rounding of the vocabulary (TRL's default pads it to a multiple of 64 with dummy tokens).
    clone_chat_template(model, tokenizer, path, resize_to_multiple_of=None)
    return [t for t in tokenizer.get_vocab() if t not in vocab]


def write_record(record: dict, model_dir) -> None:
    from snaketrl.io import write_json

    write_json(record, Path(model_dir) / RECORD_FILE)


def read_record(model_dir) -> dict | None:
    """The chat template record of a model directory given one here (or merged from one), None for any other."""
    path = Path(model_dir) / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def trainable_tokens(model, model_dir, lora: dict) -> dict:
    """`lora` (peft LoraConfig fields) with the rows of the tokens the template added made trainable in the input
    embeddings and the output projection (peft's trainable_token_indices: only those rows train, and a tied
    output projection follows its embeddings). Unchanged for a model without added tokens, and for a layer that
    lora.modules_to_save trains whole."""
    record = read_record(model_dir)
    ids = sorted((record or {}).get("added_tokens", {}).values())
    if not ids:
        return lora
    names = [name for name in (layer_name(model, model.get_input_embeddings()),
                                layer_name(model, model.get_output_embeddings())) if name]
    whole = set(lora.get("modules_to_save") or [])
    indices = {name: list(ids) for name in names if name not in whole}
    return {**lora, "trainable_token_indices": indices} if indices else lora


def trains_added_rows(model_dir, lora: dict) -> bool:
    """Whether the run trains rows a chat template added as rows of the output projection (trainable_tokens), as far
    as a plan sees before the model loads: added tokens recorded, and the head (transformers' `lm_head`) not trained
    whole by lora.modules_to_save."""
    return bool((read_record(model_dir) or {}).get("added_tokens")) and "lm_head" not in set(
        lora.get("modules_to_save") or [])


def trains_token_rows(model_dir, lora: dict) -> bool:
    """Whether the run trains rows a chat template added as trainable tokens of any layer (`trainable_tokens`: the
    input embeddings' or the output projection's), as far as a plan sees before the model loads: added tokens
    recorded, and not both layers (transformers' `embed_tokens` and `lm_head`) trained whole by
    lora.modules_to_save."""
    return bool((read_record(model_dir) or {}).get("added_tokens")) and not {"embed_tokens", "lm_head"} <= set(
        lora.get("modules_to_save") or [])


def layer_name(model, layer) -> str | None:
    """A layer's own name (embed_tokens, lm_head), as peft's trainable_token_indices names it."""
    if layer is None:
        return None
    return next(n for n, m in model.named_modules() if m is layer).rsplit(".", 1)[-1]


def trains_head_rows(model, lora: dict) -> bool:
    """Whether rows of the output projection train as trainable tokens: peft then wraps it in a layer whose weight
    TRL's chunked SFT loss (which reads the projection's weight itself) cannot use."""
    return layer_name(model, model.get_output_embeddings()) in (lora.get("trainable_token_indices") or {})
