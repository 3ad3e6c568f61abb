"""The tokenizer set-up every stage relies on: a pad token distinct from eos.
"""

from __future__ import annotations


def prepare_tokenizer(tokenizer, model=None, padding_side: str | None = None):
    """A pad token distinct from eos (PPO and the reward model build masks from `!= pad_token_id`). A tokenizer
    without one takes its unknown token where that is neither eos nor bos (SmolLM2's <|endoftext|>: the model
    keeps its vocabulary, so adapters and merged models keep its shapes); else (Pythia) it gets a new one, with
    embeddings grown if needed."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        unk = tokenizer.unk_token
        if unk is not None and tokenizer.unk_token_id not in (tokenizer.eos_token_id, tokenizer.bos_token_id):
            tokenizer.pad_token = unk
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    if padding_side:
        tokenizer.padding_side = padding_side
    if model is not None:
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def same_tokenizer(a, b) -> bool:
    return (a.get_vocab() == b.get_vocab()
            and (a.pad_token_id, a.eos_token_id, a.bos_token_id) == (b.pad_token_id, b.eos_token_id, b.bos_token_id))
