"""A tiny random-init model with its own BPE tokenizer, trained on the model's corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

from snaketrl.models.chat_template import CHATML

SPECIAL_TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}


EXTRA_TOKENS = ["<|im_start|>"]


def iter_texts(value):
    """Every string inside a JSON value (messages, nested lists)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_texts(v)
    elif isinstance(value, list):
        for v in value:
            yield from iter_texts(v)


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (as GPT-2, Pythia and Qwen use) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [*SPECIAL_TOKENS.values(), *EXTRA_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS,
                                   additional_special_tokens=EXTRA_TOKENS)
    fast.chat_template = CHATML
    return fast


def build_tiny(tiny: dict, texts, out_dir: str | Path, seed: int) -> None:
    """Train the tokenizer, random-init the model from a small config, save both (safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketrl.io import atomic

    tokenizer = train_tokenizer(texts, tiny.get("vocab_size", 1024))
    config = AutoConfig.for_model(
        tiny["model_type"], vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **tiny.get("config", {}))
    # Tokenizers trained here would otherwise claim an unbounded context.
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic(out_dir, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def corpus_texts(files):
    """Every text of the corpus files: each string inside each row of a .jsonl file, each line of a .txt file."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                if str(path).endswith(".jsonl"):
                    yield from iter_texts(json.loads(line))
                else:
                    yield line.rstrip("\n")


def build_tiny_from_files(tiny: dict, corpus, out_dir, seed: int, threads: int | None = None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)
    build_tiny(tiny, corpus_texts(corpus), out_dir, seed)
