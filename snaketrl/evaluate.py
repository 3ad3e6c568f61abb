"""One yardstick for every run: generation, scores, likelihood metrics, lm-eval, one SQLite database.

Each function works on a loaded model and plain lists, so each is testable on a tiny model; `evaluate`
is the eval job (one per run and one per base model), `collect` builds the database from every job's
files. Heavy imports (torch, transformers, peft, lm_eval) happen inside functions: importing this module
is cheap. Parse-time checks live in snaketrl.evaluation_config.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sqlite3
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from snaketrl.data import is_conversational, read_jsonl
from snaketrl.errors import ConfigError, DataError
from snaketrl.evaluation_config import (KINDS, LM_EVAL_PIN, LM_EVAL_TASKS_DIR, check_rows, reward_func_name,
                                        score_name)

log = logging.getLogger("snaketrl.evaluate")

KL_ESTIMATOR = ("k1: mean over completions of sum over completion tokens of log p_run - log p_base, on the run's "
                "own completions")


# --- Loading -------------------------------------------------------------------------------------

@dataclass
class Loaded:
    """A model in eval mode and its tokenizer (left padding, pad distinct from eos). `reference()` is a
    context in which the model is its base: the adapter disabled (peft); None for a plain model."""

    model: object
    tokenizer: object
    has_reference: bool = False
    device: str = "cpu"

    def reference(self):
        if not self.has_reference:
            raise ValueError("a plain (or merged) model has no base to disable its adapter to")
        return self.model.disable_adapter()


def load_for_eval(model_dir, adapter_dir=None, *, threads: int | None = None) -> Loaded:
    """Base model + LoRA adapter (peft, adapter kept separate so `reference()` gives the base without a
    second copy), or a plain/merged model. The tokenizer is the adapter's (training may have added a pad
    token) or the model's."""
    import torch
    import transformers

    from snaketrl.train import prepare_tokenizer

    if threads:
        torch.set_num_threads(threads)
    if adapter_dir is not None:
        task = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("task_type")
        if task not in (None, "CAUSAL_LM"):
            raise ConfigError(f"evaluate: {adapter_dir} is a {task} adapter (a reward model), not a language "
                              f"model; reward models judge (evaluation.reward_models), they are not evaluated")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir or model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    prepare_tokenizer(tokenizer, model, padding_side="left")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(device).eval()
    return Loaded(model, tokenizer, has_reference=adapter_dir is not None, device=device)


def _max_positions(model, default: int = 2048) -> int:
    return getattr(model.config, "max_position_embeddings", None) or default


def _stop_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


# --- Generation ----------------------------------------------------------------------------------

@dataclass
class Generated:
    texts: list[str]  # decoded, special tokens dropped
    n_tokens: list[int]  # generated tokens, the closing eos included (as TRL's completions/mean_length)
    token_ids: list[list[int]] = field(repr=False)  # those tokens
    prompt_ids: list[list[int]] = field(repr=False)  # the prompt as the model saw it (unpadded)


def generate(model, tokenizer, prompts, *, max_new_tokens: int, do_sample: bool = False, batch_size: int = 16,
             temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None) -> Generated:
    """One completion per prompt, in batches, left-padded; conversational prompts through the chat
    template (snaketrl.lengths.prompt_texts). Greedy unless do_sample (then top_k is off, so the k1 KL
    estimate sees the distribution sampled from). Prompts longer than the model's context minus
    max_new_tokens keep their end."""
    import torch
    from transformers import GenerationConfig, set_seed

    from snaketrl.lengths import prompt_texts

    if not prompts:
        return Generated([], [], [], [])
    texts, special = prompt_texts(tokenizer, list(prompts))
    keep = max(1, _max_positions(model) - max_new_tokens)
    prompt_ids = [ids[-keep:] for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]
    stops = _stop_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=stops, **({"temperature": temperature, "top_p": top_p, "top_k": 0}
                                                     if do_sample else {}))
    if seed is not None:
        set_seed(seed)
    device = next(model.parameters()).device
    out_ids = []
    for start in range(0, len(prompt_ids), batch_size):
        batch = tokenizer.pad({"input_ids": prompt_ids[start:start + batch_size]}, padding=True,
                              padding_side="left", return_tensors="pt").to(device)
        with torch.inference_mode():
            out = model.generate(**batch, generation_config=config)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            out_ids.append(row[:cut])
    return Generated([tokenizer.decode(ids, skip_special_tokens=True) for ids in out_ids],
                     [len(ids) for ids in out_ids], out_ids, prompt_ids)


# --- Scores --------------------------------------------------------------------------------------

def _as_completions(prompts, completions):
    """Completions as reward functions and judges get them: messages where the prompts are."""
    if prompts and is_conversational(prompts[0]):
        return [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
    return list(completions)


def reward_function_scores(entries, prompts, completions, columns: dict | None = None) -> dict[str, list[float]]:
    """score name (fn_<function>) -> one float per completion, each configured reward function called
    as TRL calls it: f(prompts=..., completions=..., **other dataset columns)."""
    from snaketrl.rewards import resolve

    columns = columns or {}
    comps = _as_completions(prompts, completions)
    out = {}
    for entry, func in zip(entries, resolve(entries)):
        name = score_name("fn", reward_func_name(entry))
        values = func(prompts=list(prompts), completions=comps, **columns)
        if len(values) != len(comps):
            raise DataError(f"reward function '{reward_func_name(entry)}' returned {len(values)} scores for "
                            f"{len(comps)} completions")
        out[name] = [float("nan") if v is None else float(v) for v in values]
    return out


def judge_texts(tokenizer, prompts, completions) -> tuple[list[str], bool]:
    """prompt+completion as text in a judge's own format: its chat template for conversations, else
    prompt + completion + its eos, as TRL's RewardTrainer trained it. Returns (texts, add_special_tokens)."""
    comps = _as_completions(prompts, completions)
    if prompts and is_conversational(prompts[0]):
        if not tokenizer.chat_template:
            raise ConfigError(f"evaluation.reward_models: the judge's tokenizer ({tokenizer.name_or_path}) has no chat "
                              f"template, and the prompts are conversations")
        return tokenizer.apply_chat_template([list(p) + list(c) for p, c in zip(prompts, comps)], tokenize=False), False
    return [p + c + (tokenizer.eos_token or "") for p, c in zip(prompts, comps)], True


def reward_model_scores(reward_dir, prompts, completions, *, batch_size: int = 16) -> list[float]:
    """A reward model's score (logit of its single label) per completion. It reads text, re-tokenized
    with its own tokenizer, so a reward model of another family judges as well."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    if model.config.num_labels != 1:
        raise ConfigError(f"evaluate: {reward_dir} has {model.config.num_labels} labels; a reward model has one")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()
    texts, special = judge_texts(tokenizer, list(prompts), list(completions))
    tokenizer.truncation_side = "left"  # a text too long keeps its end: the completion being judged
    limit = _max_positions(model, tokenizer.model_max_length)
    scores = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], padding=True, padding_side="right", truncation=True,
                        max_length=limit, add_special_tokens=special, return_tensors="pt").to(device)
        with torch.inference_mode():
            scores += model(**enc).logits[:, 0].float().tolist()
    del model
    return scores


# --- Aggregates ----------------------------------------------------------------------------------

def _finite(values):
    return [v for v in values if v is not None and not math.isnan(v)]


def mean_std(values) -> dict:
    """mean and (population) std of the finite values; None for none."""
    vals = _finite(values)
    if not vals:
        return {"mean": None, "std": None}
    mean = sum(vals) / len(vals)
    return {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))}


def win_rate(scores, reference) -> float | None:
    """Share of prompts where the run's completion scores above the reference's for the same prompt;
    a tie counts 0.5; pairs with a missing (None/NaN) score are left out."""
    pairs = [(a, b) for a, b in zip(scores, reference, strict=True)
             if a is not None and b is not None and not math.isnan(a) and not math.isnan(b)]
    if not pairs:
        return None
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)


def distinct_n(texts, n: int = 2) -> float | None:
    """Unique word n-grams / all word n-grams over all completions (words: whitespace-split, so runs of
    models with different tokenizers compare). n-grams do not cross completions. None when there are none."""
    total, unique = 0, set()
    for text in texts:
        words = text.split()
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        total += len(grams)
        unique.update(grams)
    return len(unique) / total if total else None


# --- Likelihood ----------------------------------------------------------------------------------

def encode_pairs(tokenizer, prompts, completions) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per example, as TRL's SFT builds its completion mask: the prompt
    rendered alone, and prompt+completion rendered together (chat template for conversations; plain text
    gets the eos SFT appends); the completion is what follows the prompt's tokens."""
    from snaketrl.lengths import _texts, prompt_texts

    p_texts, p_special = prompt_texts(tokenizer, list(prompts))
    full_texts, f_special = _texts(tokenizer, list(prompts), list(completions))
    p_ids = tokenizer(p_texts, add_special_tokens=p_special)["input_ids"]
    f_ids = tokenizer(full_texts, add_special_tokens=f_special)["input_ids"]
    out = []
    for p, f in zip(p_ids, f_ids):
        n = len(p) if f[:len(p)] == p else _common_prefix(p, f)
        out.append((f[:n], f[n:]))
    return out


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def token_logprobs(model, pairs, *, pad_token_id: int, batch_size: int = 16, temperature: float = 1.0,
                   max_length: int | None = None, start_token_id: int | None = None) -> list:
    """log p(token | everything before it) of each completion token, per (prompt ids, completion ids)
    pair. Batches are left-padded with explicit position ids, so every completion ends at the right edge
    and only the last (longest completion + 1) positions' logits are computed where the model allows
    (`logits_to_keep`): a long prompt costs no vocabulary-sized logits. A pair too long for `max_length`
    (default: the model's context) loses prompt tokens from the left, then completion tokens from the
    right; an empty prompt becomes `start_token_id` (default: the pad token)."""
    import inspect

    import numpy as np
    import torch

    max_length = max_length or _max_positions(model)
    start_token_id = pad_token_id if start_token_id is None else start_token_id
    device = next(model.parameters()).device
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    can_keep = "logits_to_keep" in inspect.signature(inner.forward).parameters
    out = []
    for start in range(0, len(pairs), batch_size):
        seqs, n_completion = [], []
        for p, c in pairs[start:start + batch_size]:
            c = list(c)[:max_length - 1]
            p = list(p)[-(max_length - len(c)):] or [start_token_id]  # the first completion token needs a context
            seqs.append(p + c)
            n_completion.append(len(c))
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq)
            mask[i, width - len(seq):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(n_completion) + 1
        kwargs = {"logits_to_keep": keep} if can_keep else {}
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                           **kwargs).logits
        logits = logits[:, -keep:].float()  # positions width-keep .. width-1
        if temperature != 1.0:
            logits = logits / temperature
        # The logit at position j predicts token j+1; log_softmax only where gathered: logit - logsumexp.
        targets = ids[:, width - keep + 1:].to(device)
        lp = (logits[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits[:, :-1].logsumexp(-1)).cpu().numpy()
        for i, n in enumerate(n_completion):
            out.append(np.asarray(lp[i, lp.shape[1] - n:], dtype=np.float64))
    return out


def completion_nll(model, tokenizer, prompts, completions, *, batch_size: int = 16) -> dict:
    """Held-out NLL of reference completions: loss on completion tokens only (as SFT's completion_only_loss),
    mean per token over all references, and its perplexity."""
    pairs = encode_pairs(tokenizer, prompts, completions)
    lps = token_logprobs(model, pairs, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)
    total = sum(float(-x.sum()) for x in lps)
    n = sum(len(x) for x in lps)
    nll = total / n if n else None
    return {"nll": nll, "perplexity": math.exp(nll) if nll is not None else None, "n_references": len(pairs),
            "n_tokens": n}


def sequence_logps(model, tokenizer, prompts, completions, *, batch_size: int = 16):
    """log p(completion | prompt) summed over the completion's tokens, per example (numpy array)."""
    import numpy as np

    pairs = encode_pairs(tokenizer, prompts, completions)
    lps = token_logprobs(model, pairs, pad_token_id=tokenizer.pad_token_id, batch_size=batch_size)
    return np.array([float(x.sum()) for x in lps])


def preference_accuracy(loaded: Loaded, prompts, chosen, rejected, *, batch_size: int = 16) -> dict:
    """On held-out pairs:
    - `accuracy`: share of pairs where the run's implicit reward prefers chosen, as DPO's rewards/accuracies:
      (logp_run(chosen) - logp_base(chosen)) > (logp_run(rejected) - logp_base(rejected)), ties not counted
      as wins. Undefined (None) without a base to compare with: the base model itself, a merged model.
    - `logp_accuracy`: share where logp(chosen) > logp(rejected) under the model itself (every row, the base's
      included: what the run starts from).
    - `margin`: mean implicit reward margin (beta = 1), None without a base."""
    model, tok = loaded.model, loaded.tokenizer
    run_c = sequence_logps(model, tok, prompts, chosen, batch_size=batch_size)
    run_r = sequence_logps(model, tok, prompts, rejected, batch_size=batch_size)
    out = {"n_pairs": len(run_c), "logp_accuracy": float((run_c > run_r).mean()) if len(run_c) else None,
           "accuracy": None, "margin": None}
    if loaded.has_reference and len(run_c):
        with loaded.reference():
            base_c = sequence_logps(model, tok, prompts, chosen, batch_size=batch_size)
            base_r = sequence_logps(model, tok, prompts, rejected, batch_size=batch_size)
        reward_c, reward_r = run_c - base_c, run_r - base_r
        out["accuracy"] = float((reward_c > reward_r).mean())
        out["margin"] = float((reward_c - reward_r).mean())
    return out


def kl_to_reference(loaded: Loaded, generated: Generated, *, batch_size: int = 16,
                    temperature: float = 1.0) -> list[float] | None:
    """Per completion, sum over its tokens of log p_run - log p_base, on the run's own completions: the
    k1 estimator of KL(run || base) is their mean. Unbiased when the completions were sampled from the run
    (generation.do_sample: true, temperature as given); on greedy completions it is the log-ratio of the
    run's most likely continuations, a proxy. None for a model without a base (the base itself, merged)."""
    if not loaded.has_reference:
        return None
    pairs = list(zip(generated.prompt_ids, generated.token_ids))
    kw = dict(pad_token_id=loaded.tokenizer.pad_token_id, batch_size=batch_size, temperature=temperature)
    run = token_logprobs(loaded.model, pairs, **kw)
    with loaded.reference():
        base = token_logprobs(loaded.model, pairs, **kw)
    return [float((r - b).sum()) for r, b in zip(run, base)]


# --- lm-evaluation-harness -----------------------------------------------------------------------

def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ConfigError(f"evaluation.lm_eval: lm-eval is not installed ({err}); pip install {LM_EVAL_PIN}") from None
    return lm_eval, HFLM, TaskManager


def _lm_eval_available() -> bool:
    from snaketrl.evaluation_config import lm_eval_installed

    return lm_eval_installed() is not None


def lm_eval_task_manager(tasks, include_path=LM_EVAL_TASKS_DIR):
    """lm-eval's TaskManager with the project's tasks (and lm-eval's own only when a task needs them:
    indexing those takes seconds). An unknown task is a one-line ConfigError, found by a text scan of the
    task YAMLs before lm-eval indexes anything; cheap enough to call before the model loads."""
    from snaketrl.evaluation_config import check_lm_eval_tasks, project_tasks

    _, _, TaskManager = _import_lm_eval()
    check_lm_eval_tasks(tasks, "evaluation.lm_eval.tasks")
    own = project_tasks() if Path(include_path) == LM_EVAL_TASKS_DIR else set()
    manager = TaskManager(include_path=str(include_path), include_defaults=any(t not in own for t in tasks))
    missing = [t for t in tasks if t not in set(manager.all_tasks)]
    if missing:  # the scan took it for a task, lm-eval does not
        raise ConfigError(f"evaluation.lm_eval.tasks: lm-eval has no task '{missing[0]}'")
    return manager


def lm_eval_run(model, tokenizer, tasks, *, limit=None, batch_size: int = 8, num_fewshot=None, seed: int = 0,
                task_manager=None, max_length: int | None = None) -> dict:
    """lm-eval's simple_evaluate on a loaded model (a peft model is passed with its adapter active).
    Returns {task: {metric,filter: value}} (stderr entries dropped). Project tasks read their data relative
    to the working directory (the project root, as for Snakemake)."""
    lm_eval, HFLM, _ = _import_lm_eval()
    task_manager = task_manager or lm_eval_task_manager(tasks)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA layers stay active
    lm = HFLM(pretrained=inner, tokenizer=tokenizer, batch_size=batch_size,
              max_length=max_length or _max_positions(inner))
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
    out = {}
    for task, values in results["results"].items():
        out[task] = {k: v for k, v in values.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in k}
    return out


# --- The eval job --------------------------------------------------------------------------------

def _rows(path, kind: str, size, where: str) -> list[dict]:
    rows = read_jsonl(path)
    check_rows(rows, kind, f"{where}: {path}")
    return rows[:size] if size else rows


def _prompt_key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)


def evaluate(*, target: dict, settings: dict, model_dir, out_completions, out_metrics, adapter_dir=None,
             prompts_file=None, references_file=None, pairs_file=None, reward_models: dict | None = None,
             reference_completions=None, threads: int | None = None) -> dict:
    """One eval job: the model (base + adapter, or a base alone) loaded once; every input checked before it
    loads. `target`: run, model, trainer, seed (snaketrl.evaluation_config.eval_targets). `settings`: the
    checked evaluation section. `reward_models`: run name -> merged directory. `reference_completions`: the
    completions file of the reference's eval job (its base), for win rates. Writes the per-prompt JSON Lines
    and the metrics JSON, each atomically; returns the metrics."""
    from snaketrl.data import write_jsonl
    from snaketrl.io import write_json

    started = time.perf_counter()
    name = target.get("name") or target["run"] or f"base-{target['model']}"
    where = f"evaluate {name}"
    reward_models = dict(reward_models or {})
    gen = settings["generation"]
    lm_tasks = settings["lm_eval"]["tasks"]
    # Every input is checked before the model loads.
    prompts_rows = _rows(prompts_file, "prompts", settings["prompts"]["size"], where) if prompts_file else None
    ref_rows = _rows(references_file, "references", settings["references"]["size"], where) if references_file else None
    pair_rows = _rows(pairs_file, "pairs", settings["pairs"]["size"], where) if pairs_file else None
    reference = read_jsonl(reference_completions) if reference_completions else None
    if reference is not None and prompts_rows is not None:
        if [_prompt_key(r["prompt"]) for r in reference] != [_prompt_key(r["prompt"]) for r in prompts_rows]:
            raise DataError(f"{where}: the reference's completions ({reference_completions}) are for other prompts; "
                            f"rerun its eval job with the same evaluation.prompts")
    manager = lm_eval_task_manager(lm_tasks) if lm_tasks else None
    for rm_name, rm_dir in reward_models.items():
        if not (Path(rm_dir) / "config.json").is_file():
            raise ConfigError(f"{where}: reward model '{rm_name}' has no merged model at {rm_dir}")

    timing, metrics = {"checks": time.perf_counter() - started}, {}
    t = time.perf_counter()
    loaded = load_for_eval(model_dir, adapter_dir, threads=threads)
    seed = target.get("seed", 0)
    timing["load"] = time.perf_counter() - t
    rows = []
    if prompts_rows is not None:
        t = time.perf_counter()
        prompts = [r["prompt"] for r in prompts_rows]
        generated = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=gen["max_new_tokens"],
                             do_sample=gen["do_sample"], batch_size=gen["batch_size"], temperature=gen["temperature"],
                             top_p=gen["top_p"], seed=seed)
        timing["generate"] = time.perf_counter() - t
        t = time.perf_counter()
        kl = kl_to_reference(loaded, generated, batch_size=settings["batch_size"],
                             temperature=gen["temperature"] if gen["do_sample"] else 1.0)
        timing["kl"] = time.perf_counter() - t
        rows = [{"prompt_id": i, "prompt": p, "completion": c, "n_tokens": n}
                for i, (p, c, n) in enumerate(zip(prompts, generated.texts, generated.n_tokens))]
        if kl is not None:
            for row, value in zip(rows, kl):
                row["kl_k1"] = value
        metrics.update(n_prompts=len(rows), mean_length=mean_std(generated.n_tokens)["mean"],
                       distinct_2=distinct_n(generated.texts, 2), kl_k1=mean_std(kl)["mean"] if kl else None,
                       kl_estimator=KL_ESTIMATOR + ("" if gen["do_sample"] else " (greedy: a proxy, not unbiased)"))
    if ref_rows is not None:
        t = time.perf_counter()
        metrics["references"] = completion_nll(loaded.model, loaded.tokenizer, [r["prompt"] for r in ref_rows],
                                               [r["completion"] for r in ref_rows], batch_size=settings["batch_size"])
        timing["nll"] = time.perf_counter() - t
    if pair_rows is not None:
        t = time.perf_counter()
        metrics["pairs"] = preference_accuracy(loaded, [r["prompt"] for r in pair_rows],
                                               [r["chosen"] for r in pair_rows], [r["rejected"] for r in pair_rows],
                                               batch_size=settings["batch_size"])
        timing["preference"] = time.perf_counter() - t
    if lm_tasks:
        t = time.perf_counter()
        lm = settings["lm_eval"]
        metrics["lm_eval"] = lm_eval_run(loaded.model, loaded.tokenizer, lm_tasks, limit=lm["limit"],
                                         batch_size=lm["batch_size"], num_fewshot=lm["num_fewshot"], seed=seed,
                                         task_manager=manager)
        timing["lm_eval"] = time.perf_counter() - t
    del loaded

    if prompts_rows is not None:
        t = time.perf_counter()
        prompts, texts = [r["prompt"] for r in prompts_rows], [r["completion"] for r in rows]
        columns = {k: [r.get(k) for r in prompts_rows] for k in prompts_rows[0] if k != "prompt"}
        scores = reward_function_scores(settings["reward_funcs"], prompts, texts, columns)
        for rm_name, rm_dir in reward_models.items():
            scores[score_name("rm", rm_name)] = reward_model_scores(rm_dir, prompts, texts,
                                                                     batch_size=settings["batch_size"])
        timing["scores"] = time.perf_counter() - t
        metrics["scores"] = {}
        for score, values in scores.items():
            for row, value in zip(rows, values):
                row[score] = value
            entry = mean_std(values)
            entry["win_rate"] = (win_rate(values, [r.get(score) for r in reference])
                                 if reference is not None else None)
            metrics["scores"][score] = entry

    info = {"run": name, "model": target["model"], "trainer": target["trainer"], "seed": seed,
            "reference": target.get("reference")}
    rows = [{**info, **row} for row in rows]
    timing["total"] = time.perf_counter() - started
    metrics = {**info, **metrics, "timing_s": timing}
    write_jsonl(rows, out_completions)
    write_json(metrics, out_metrics)
    return metrics


# --- The database --------------------------------------------------------------------------------

COMPLETION_COLUMNS = ["run", "model", "trainer", "seed", "prompt_id", "prompt", "completion", "n_tokens"]
SAMPLE_COLUMNS = ["run", "step", "prompt", "completion", "reward"]


def flatten(obj: dict, prefix: str = "") -> dict:
    """Nested metrics as SQL-friendly column names: {"scores": {"fn_x": {"mean": 1}}} -> scores_fn_x_mean."""
    out = {}
    for key, value in obj.items():
        col = re.sub(r"\W+", "_", f"{prefix}{key}").strip("_")
        if isinstance(value, dict):
            out.update(flatten(value, col + "_"))
        else:
            out[col] = value
    return out


def _sql_value(value):
    if value is None or isinstance(value, (int, float, str, bytes)):
        return None if isinstance(value, float) and math.isnan(value) else value
    return json.dumps(value, ensure_ascii=False)


def _create(db, table: str, columns: list[str], rows: list[dict]) -> None:
    db.execute(f'CREATE TABLE "{table}" ({", ".join(f"{chr(34)}{c}{chr(34)}" for c in columns)})')
    marks = ", ".join("?" * len(columns))
    db.executemany(f'INSERT INTO "{table}" VALUES ({marks})', [[_sql_value(r.get(c)) for c in columns] for r in rows])


def collect(jsonl_files, db_path, *, metrics_files=None, samples_files=()) -> dict:
    """One SQLite database from every eval job: `completions` (one row per run x prompt: run, model,
    trainer, seed, prompt_id, prompt, completion, n_tokens, then one column per score), `metrics` (one row
    per run, nested metrics flattened), `training_samples` (run, step, prompt, completion, reward, from
    GRPO's/PPO's training logs: snaketrl.training_samples). `metrics_files` default to the metrics.json
    beside each completions file. Written under a temporary name, then renamed. Returns row counts."""
    from snaketrl.io import atomic

    jsonl_files = [Path(p) for p in jsonl_files]
    metrics_files = [Path(p) for p in metrics_files] if metrics_files is not None else [
        p.with_name("metrics.json") for p in jsonl_files]
    completions = [row for path in jsonl_files for row in read_jsonl(path)]
    metrics = [flatten(json.loads(Path(p).read_text())) for p in metrics_files if Path(p).is_file()]
    samples = [row for path in samples_files for row in read_jsonl(path)]
    extra = sorted({k for r in completions for k in r} - set(COMPLETION_COLUMNS))
    metric_cols = list(dict.fromkeys(["run", "model", "trainer", "seed", *(k for m in metrics for k in m)]))
    sample_cols = list(dict.fromkeys([*SAMPLE_COLUMNS, *(k for r in samples for k in r)]))
    with atomic(db_path) as tmp:
        db = sqlite3.connect(tmp)
        try:
            _create(db, "completions", COMPLETION_COLUMNS + extra, completions)
            _create(db, "metrics", metric_cols, metrics)
            _create(db, "training_samples", sample_cols, samples)
            db.execute("CREATE INDEX completions_run ON completions (run, prompt_id)")
            db.commit()
        finally:
            db.close()
    return {"completions": len(completions), "metrics": len(metrics), "training_samples": len(samples)}


def main(argv=None) -> None:
    import sys

    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    print(json.dumps(evaluate(**job), indent=2, default=str))


if __name__ == "__main__":
    main()
