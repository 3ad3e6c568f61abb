"""Prompts as chat turns for chat models: TRL renders conversational rows with the tokenizer's chat template.

Which rows become chats is decided per (model, dataset) when the config is read (snaketrl.config.resolve.chat_prompts):
preprocessing is shared by every model, so the conversion happens where the model is known, the same way in
each place that tokenizes a row (the length histogram, PPO's prompt tokenization, training, evaluation).
"""

from __future__ import annotations

import re

from snaketrl.data.formats import is_conversational
from snaketrl.errors import ConfigError

# An Anthropic HH transcript, as snaketrl.data.formats.from_hh leaves its prompt: "\n\nHuman: ...\n\nAssistant:".
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}
# Text columns the assistant writes.
ANSWERS = ("completion", "chosen", "rejected")


def hh_turns(prompt: str) -> list[dict] | None:
    """The turns of an HH transcript prompt, which ends where the assistant is to answer; None for other text."""
    text = prompt if prompt.startswith("\n\n") else "\n\n" + prompt
    if not text.startswith("\n\nHuman:") or not text.rstrip().endswith("\n\nAssistant:"):
        return None
    parts = _HH_TURN.split(text.rstrip())  # ["", role, content, role, content, ..., "Assistant", ""]
    turns = [{"role": _HH_ROLES[role], "content": content.strip()} for role, content in zip(parts[1::2], parts[2::2])]
    return turns[:-1]  # the last, empty Assistant turn is the one to generate


def as_chat(rows: list[dict]) -> list[dict]:
    """Rows with plain-text prompts as conversations: an HH transcript becomes its alternating turns, any other
    prompt one user turn; completion, chosen and rejected become the assistant's turn. Whitespace that joined a
    plain prompt to its completion is dropped (the template separates turns). Conversational rows, and columns
    without text (an `answer` the reward reads, a `text` document), are left as they are."""
    out = []
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            out.append(row)
            continue
        new = dict(row)
        new["prompt"] = hh_turns(prompt) or [{"role": "user", "content": prompt.strip()}]
        for column in ANSWERS:
            if isinstance(row.get(column), str):
                new[column] = [{"role": "assistant", "content": row[column].strip()}]
        out.append(new)
    return out


def require_template(tokenizer, rows: list[dict], chat: bool, *, model: str, dataset: str, where: str) -> None:
    """A tokenizer that is to render chats (`chat`: the config says so; or the rows are conversations) must have a
    chat template."""
    conversational = bool(rows) and is_conversational(rows[0].get("prompt", rows[0].get("chosen")))
    if (chat or conversational) and not tokenizer.chat_template:
        # the names themselves: the parse-time check of that key lists them (snaketrl.models.chat_template)
        give = (f"give it one with models.{model}.chat_template (a template name such as chatml, a .jinja file, or "
                f"another model's tokenizer)")
        if chat:  # datasets.<d>.chat: false is then unset (or chat would be off), whatever models.<m>.chat says
            raise ConfigError(f"{where}: model '{model}' has no chat template in its tokenizer, and its prompts from "
                              f"dataset '{dataset}' are to be chats (models.{model}.chat, datasets.{dataset}.chat); "
                              f"{give}, or keep these prompts plain text with datasets.{dataset}.chat: false")
        raise ConfigError(f"{where}: model '{model}' has no chat template in its tokenizer, and the rows of dataset "
                          f"'{dataset}' are conversations; {give}")


def chat_rows(rows: list[dict], chat: bool, tokenizer, *, model: str, dataset: str, where: str) -> list[dict]:
    """`rows` as model `model` reads them: chat turns where the config says so (`chat`: snaketrl.config.resolve.chat_prompts),
    and a template to render them."""
    require_template(tokenizer, rows, chat, model=model, dataset=dataset, where=where)
    return as_chat(rows) if chat else rows
