"""Pretraining a tiny random-init model on a local corpus (causal LM, full parameters).

A plain torch loop: for models this small, transformers' Trainer costs more per step than the
model does. It still writes the files a Trainer run would: safetensors weights, the tokenizer,
and trainer_state.json whose log_history holds `loss` and `eval_loss` at every logging step.

Documents: a .jsonl row is one document, its strings (as models.iter_texts finds them) joined in
order, with a newline between two strings unless one already has whitespace at the boundary (so a
prompt/completion row reads exactly as SFT sees it: "...TL;DR: Riley hid my guitar..."). A list of
chat messages becomes the tokenizer's chat template rendering of it, as TRL renders conversational
data (its content strings alone where no template is given). A preference row (`chosen` and
`rejected`, with or without `prompt`) gives two documents, the prompt with each answer, so the
model sees both styles after a prompt, as the seeds' base models have (its other columns, such
as scores, are left out). A .txt
file holds documents separated by blank lines (a file without blank lines is one document).
Each document ends with the tokenizer's eos; documents are concatenated and cut into blocks of
`block_size` tokens. A seeded share of the documents is held out for `eval_loss`.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path

from snaketrl.data.formats import is_conversational
from snaketrl.divergence import Diverged, Scanner, describe
from snaketrl.errors import DataError
from snaketrl.imports import imports_done

CORPUS_SUFFIXES = (".jsonl", ".txt")


def iter_strings(value, render=None):
    """Every string inside a JSON value, in order; chat messages rendered by `render` if given."""
    if isinstance(value, str):
        yield value
    elif is_conversational(value) and render is not None:
        yield render(value)
    elif is_conversational(value):
        yield from (m["content"] for m in value if isinstance(m.get("content"), str))
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_strings(v, render)
    elif isinstance(value, list):
        for v in value:
            yield from iter_strings(v, render)


def join_strings(strings) -> str:
    out = ""
    for s in strings:
        if out and s and not out[-1].isspace() and not s[0].isspace():
            out += "\n"
        out += s
    return out


def row_documents(row, render=None) -> list[str]:
    if isinstance(row, dict) and "chosen" in row and "rejected" in row:
        prompt = row.get("prompt", "")
        pairs = [prompt + row[k] if is_conversational(prompt) and is_conversational(row[k]) else [prompt, row[k]]
                 for k in ("chosen", "rejected")]
        return [join_strings(iter_strings(value, render)) for value in pairs]
    return [join_strings(iter_strings(row, render))]


def read_corpus(files, render=None) -> list[str]:
    """Documents of every corpus file, in order; `render` turns a list of chat messages into text."""
    docs: list[str] = []
    for path in map(Path, files):
        if path.suffix not in CORPUS_SUFFIXES:
            raise DataError(f"pretraining corpus: file {path}: unsupported format '{path.suffix}'; expected "
                            f"one of {list(CORPUS_SUFFIXES)}")
        if not path.is_file():
            raise DataError(f"pretraining corpus: file {path} does not exist")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"pretraining corpus: file {path}, line {n}: not JSON ({err})") from None
                    docs += row_documents(row, render)
        else:
            docs += [d.strip("\n") for d in re.split(r"\n\s*\n", text)]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"pretraining corpus: no text in {[str(f) for f in files]}")
    return docs


def split_documents(docs: list[str], eval_share: float, seed: int) -> tuple[list[str], list[str]]:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(docs) * eval_share)) if eval_share > 0 and len(docs) > 1 else 0
    held = set(order[:n_eval])
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


def pack(tokenizer, docs: list[str], block_size: int):
    """Token ids of the documents, each followed by eos, cut into full blocks: a (blocks, block_size) tensor."""
    import torch

    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    flat = [t for doc in ids for t in (*doc, tokenizer.eos_token_id)]
    n = len(flat) // block_size
    return torch.tensor(flat[: n * block_size], dtype=torch.long).view(n, block_size), len(flat)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def evaluate(model, blocks, batch_size: int) -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch_size):
            batch = blocks[i:i + batch_size]
            total += _loss(model, batch).item() * len(batch)
            count += len(batch)
    model.train()
    return total / count


def pretrain(model_dir, corpus_files, out_dir, *, steps: int = 300, seed: int = 42, block_size: int = 128,
             batch_size: int = 16, learning_rate: float = 3e-3, eval_share: float = 0.1,
             logging_steps: int | None = None, max_eval_blocks: int = 64, threads: int | None = None,
             name: str = "?") -> dict:
    """Pretrain the model in `model_dir` on `corpus_files`; save model, tokenizer and trainer_state.json
    to `out_dir`; return the final metrics. Raises Diverged (model `name`) at the first logging step whose
    loss, gradient norm or held-out loss is not finite."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    render = (lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)) if tokenizer.chat_template \
        else None
    docs = read_corpus(corpus_files, render)
    train_docs, eval_docs = split_documents(docs, eval_share, seed)
    train_blocks, train_tokens = pack(tokenizer, train_docs, block_size)
    if len(train_blocks) == 0:
        raise DataError(f"pretraining corpus: {train_tokens} tokens, fewer than one block of {block_size}")
    eval_blocks = pack(tokenizer, eval_docs, block_size)[0][:max_eval_blocks] if eval_docs else None
    if eval_blocks is not None and len(eval_blocks) == 0:
        # A held-out share smaller than one block: evaluate its tokens as one short block.
        ids = tokenizer(eval_docs, add_special_tokens=False)["input_ids"]
        eval_blocks = torch.tensor([[t for d in ids for t in (*d, tokenizer.eos_token_id)]])

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    imports_done()
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=learning_rate, betas=(0.9, 0.95))
    logging_steps = logging_steps or max(1, steps // 20)
    warmup = max(1, steps // 20)
    gen = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(len(train_blocks), generator=gen), 0
    history, window = [], []
    scanner = Scanner()
    tokens_seen = 0
    for step in range(steps):
        if pos + batch_size > len(order):
            order, pos = torch.randperm(len(train_blocks), generator=gen), 0
        batch = train_blocks[order[pos:pos + batch_size]]
        pos += batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, learning_rate, warmup)
        loss = _loss(model, batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += batch.numel()
        window.append(loss.item())
        if (step + 1) % logging_steps == 0 or step + 1 == steps:
            epoch = tokens_seen / train_blocks.numel()
            logged = [{"loss": sum(window) / len(window), "grad_norm": float(grad_norm),
                       "learning_rate": optimizer.param_groups[0]["lr"], "epoch": epoch, "step": step + 1}]
            window = []
            if eval_blocks is not None:
                logged.append({"eval_loss": evaluate(model, eval_blocks, batch_size), "epoch": epoch,
                               "step": step + 1})
            for entry in logged:
                history.append(entry)
                if diverged := scanner.feed(entry):
                    raise Diverged(describe(f"model '{name}'", diverged,
                                            f"try a lower models.{name}.tiny.pretrain.learning_rate"))
    seconds = time.perf_counter() - started

    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    final_loss = next(h["loss"] for h in reversed(history) if "loss" in h)
    eval_loss = next((h["eval_loss"] for h in reversed(history) if "eval_loss" in h), None)
    metrics = {"train_loss": final_loss, "eval_loss": eval_loss, "ln_vocab": math.log(len(tokenizer)),
               "steps": steps, "train_runtime": seconds, "tokens_seen": tokens_seen,
               "train_tokens": train_tokens, "documents": len(docs), "eval_documents": len(eval_docs)}
    history.append({**{k: metrics[k] for k in ("train_loss", "train_runtime")}, "step": steps})
    state = {"global_step": steps, "max_steps": steps, "logging_steps": logging_steps, "eval_steps": logging_steps,
             "train_batch_size": batch_size, "num_train_epochs": math.ceil(tokens_seen / train_blocks.numel()),
             "log_history": history, "pretrain": {"block_size": block_size, "learning_rate": learning_rate,
                                                  "seed": seed, "corpus": [str(f) for f in corpus_files]}}
    (out_dir / "trainer_state.json").write_text(json.dumps(state, indent=2))
    return metrics


def generate_sample(model_dir, prompt: str, max_new_tokens: int = 32) -> str:
    """Greedy continuation of `prompt` (the new text only, special tokens dropped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def pretrain_model(init_dir, corpus, model_dir, state_file, metrics_file, settings: dict,
                   threads: int | None = None) -> dict:
    """The pretrain rule: pretrain the random-init model of `init_dir` on `corpus` (`settings`: steps,
    batch_size, block_size, learning_rate, eval_share, seed) into `model_dir`; its log to `state_file`,
    its final numbers and a generated sample to `metrics_file`. Each output whole or not at all."""
    import shutil

    from snaketrl.io import atomic, write_json
    from snaketrl.models.pretrain import generate_sample, pretrain

    with atomic(model_dir, directory=True) as tmp:
        metrics = pretrain(init_dir, corpus, tmp, steps=settings["steps"], seed=settings["seed"],
                           block_size=settings["block_size"], batch_size=settings["batch_size"],
                           learning_rate=settings["learning_rate"], eval_share=settings["eval_share"],
                           threads=threads, name=Path(model_dir).name)
        with atomic(state_file) as state_tmp:
            shutil.move(tmp / "trainer_state.json", state_tmp)
        prompt = SAMPLE_PROMPT
        metrics["sample_prompt"], metrics["sample"] = prompt, generate_sample(tmp, prompt, max_new_tokens=24)
    write_json(metrics, metrics_file)
    print(metrics)
    return metrics


# A prompt in the default corpus's style (the tldr sample): the report shows how the base continues it.
SAMPLE_PROMPT = "SUBREDDIT: r/relationships\n\nTITLE: My roommate borrowed my car, what now?\n\nPOST:"
