"""Models: a tiny random-init model with its own BPE tokenizer, or a Hub snapshot."""

from __future__ import annotations

import json
from pathlib import Path

# ChatML, the template of the Qwen2.5 instruct models: `<|im_end|>` closes every turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
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
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny(spec: dict, texts, out_dir: str | Path, seed: int) -> None:
    """Train the tokenizer, random-init the model from a small config, save both (safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer(texts, spec.get("vocab_size", 1024))
    config = AutoConfig.for_model(
        spec["model_type"], vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **spec.get("config", {}))
    # Tokenizers trained here would otherwise claim an unbounded context.
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def build_tiny_from_files(spec: dict, data_files, out_dir, seed: int) -> None:
    def texts():
        for path in data_files:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    yield from iter_texts(json.loads(line))

    build_tiny(spec, texts(), out_dir, seed)


HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]


def download(name: str, entry: dict, out_dir: str | Path) -> None:
    """snapshot_download of only what training needs (weights as safetensors, configs, tokenizer)."""
    from huggingface_hub import snapshot_download

    repo = entry["hub"]
    if Path(repo).is_dir():  # a local copy (pre-downloaded, or a test's fake hub)
        import shutil

        shutil.copytree(repo, out_dir, dirs_exist_ok=True)
        return
    try:
        snapshot_download(repo, revision=entry.get("revision", "main"), local_dir=out_dir,
                          allow_patterns=HUB_PATTERNS)
    except Exception as err:
        raise RuntimeError(
            f"model '{name}': could not download '{repo}' from the Hugging Face Hub: {type(err).__name__}: {err}. "
            f"Without Hub access, pre-download it elsewhere (`huggingface-cli download {repo} --local-dir DIR`), "
            f"copy DIR here and set models.{name}.hub to that directory."
        ) from err
