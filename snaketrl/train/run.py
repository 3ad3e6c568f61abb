"""The train job: one resolved run with its TRL trainer, LoRA/QLoRA, resumable checkpoints.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from contextlib import nullcontext
from pathlib import Path

from snaketrl.data.chat import chat_rows
from snaketrl.errors import TrainingError
from snaketrl.imports import imports_done, skip_deepspeed_inference_ops
from snaketrl.io import read_jsonl
from snaketrl.models.gguf import read_source
from snaketrl.models.tokenizer import prepare_tokenizer
from snaketrl.train.args import (build_args, check_args, check_hardware, check_liger_model, check_switches,
                                 split_batch, steps_for_tokens)
from snaketrl.train.distributed import SHARDED
from snaketrl.train.attention import choose as choose_attention
from snaketrl.train.attention import answering_trl_flash_warnings, routes_attention, unpad
from snaketrl.train.labelled import choose as choose_labelled
from snaketrl.train.labelled import completion_logits, use_one_pass
from snaketrl.train.loading import check_lora_targets, check_reward_tokenizer, load_model
from snaketrl.train.memory import choose_checkpointing, free_bytes
from snaketrl.trainers import REGISTRY, load

log = logging.getLogger("snaketrl.train")


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def trainer_kwargs(spec, run: dict, tokenizer, reward_dir, bf16: bool) -> dict:
    """What a trainer takes beyond model/args/data: reward functions, or PPO's reward and value models."""
    if spec.reward_funcs:
        from snaketrl.rewards import resolve

        funcs = resolve(run["reward_funcs"])
        if reward_dir:
            check_reward_tokenizer(tokenizer, reward_dir, run["name"])
            funcs.append(str(reward_dir))  # TRL loads it as a sequence classifier with its own tokenizer
        return {"reward_funcs": funcs}
    if spec.value_model:
        check_reward_tokenizer(tokenizer, reward_dir, run["name"])
        entry = {"trust_remote_code": False}
        # The value model starts as a copy of the reward model; the reference is the adapter-free policy.
        return {"reward_model": load_model(reward_dir, "reward", entry, bf16, "SEQ_CLS"),
                "value_model": load_model(reward_dir, "value", entry, bf16, "SEQ_CLS"),
                "ref_model": None}
    return {}


def forward_tokens(spec, args, max_length: int) -> int:
    """Tokens of one training forward at most: rows (a preference pair is two) x their longest; an online
    trainer's rows are a prompt (cut to max_length) and its completion."""
    rows = args.per_device_train_batch_size * (2 if spec.layout == "preference" else 1)
    completion = getattr(args, "max_completion_length", None) or getattr(args, "response_length", None) or 0
    return rows * (max_length + (completion if spec.length_field is None else 0))


def split_model_rows(trainer) -> None:
    """Run the trainer's (and a separate reference model's) forward passes in row groups (snaketrl.train.batching)."""
    from snaketrl.train.batching import split_rows

    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            split_rows(model, trainer.args.pad_to_multiple_of)


def with_lengths(dataset, tokenizer, layout: str, column: str):
    """`dataset` with each example's tokens (a pair's longer side) in `column`: TRL tokenizes preference
    pairs into columns the length-grouped sampler cannot measure, so it reads this one."""
    from snaketrl.data.lengths import sequence_lengths

    return dataset.add_column(column, sequence_lengths(dataset.to_list(), tokenizer, layout).tolist())


def check_trained(state, args, run: str, examples: int) -> None:
    """A run that made no optimizer step would still write an adapter (the untrained LoRA init), which later
    jobs would take for a trained one: fail instead, whatever led there."""
    if state.global_step > 0:
        return
    limits = ", ".join(f"{key} {getattr(args, key)}" for key in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_steps",
        "total_episodes") if getattr(args, key, None) is not None)
    raise TrainingError(f"run '{run}': training ended after 0 optimizer steps ({examples} training examples; "
                        f"{limits}); nothing was written")


def run_rows(run: dict, spec, tokenizer, train_file, eval_file) -> tuple[list[dict], list[dict]]:
    """The run's train rows and its first `eval_rows` eval rows; a chat model's prompts as chat turns in its
    template (snaketrl.data.chat; PPO's come tokenized so)."""
    train_rows, eval_rows = read_jsonl(train_file), read_jsonl(eval_file)[:run.get("eval_rows") or spec.eval_rows]
    if spec.tokenized:
        return train_rows, eval_rows
    return tuple(chat_rows(rows, run.get("chat", False), tokenizer, model=run["model"], dataset=run["dataset"],
                           where=f"run '{run['name']}'") for rows in (train_rows, eval_rows))


def train_run(run: dict, *, model_dir, train_file, eval_file, lengths_file, out_dir, checkpoint_dir,
              reward_dir=None, threads: int | None = None, callbacks=None) -> dict:
    """Train one resolved run (snaketrl.config.resolve_run); write adapter/, trainer_state.json, metrics.json
    and manifest.json into out_dir, each whole or not at all."""
    import torch

    from snaketrl import manifest
    from snaketrl.io import atomic, hash_path, write_json
    from snaketrl.train import training_samples
    from snaketrl.kill_points import kill_point
    from snaketrl.train.checkpoints import Attempt
    from snaketrl.train.guard import DivergenceGuard
    from snaketrl.train.tokens import TokenBudget, TokenCounter

    spec = REGISTRY[run["trainer"]]
    lengths = json.loads(Path(lengths_file).read_text())
    checkpoint_dir = Path(checkpoint_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The length stage's choice for this device; a histogram written before it chose one gets TRL's default.
    choice = lengths.get("batching_by_device", {}).get(device)
    if choice is None and "batching" in lengths:  # an older histogram's: a CPU's choice (row groups)
        if device != "cpu":
            raise TrainingError(f"{lengths_file}: no batching choice for {device}, only a CPU's ('batching', from "
                                f"an older snaketrl); rerun the histogram: snakemake --forcerun length_histogram")
        choice = lengths["batching"]
    choice = choice or {}
    batching, split = choice.get("args", {}), choice.get("split_rows", False)
    check_args(run["trainer"], run["args"], run["name"])  # a misspelt field is named before a missing GPU
    check_switches(run["trainer"], run["args"], f"run '{run['name']}'", run["model"], run["model_entry"])
    check_hardware(run["args"], run["name"], run["model"], run["model_entry"])
    if device == "cuda":
        check_liger_model(run["args"], model_dir, run["name"], run["model"])
    # A tiny model's numbers (learning checks, thresholds) are measured in fp32, and its 64-wide layers gain nothing
    # from bf16 units: it trains in bf16 on a bf16 GPU only. A real model also on a CPU with bf16 matrix units.
    tiny = "tiny" in run["model_entry"]
    build = dict(output_dir=str(checkpoint_dir), max_length=lengths["max_length"], seed=run["seed"], run=run["name"],
                 batching=batching, cpu_bf16=not tiny)
    # Launched (snaketrl.train.distributed): this is one of `world` processes training together.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_args, batch = split_batch(run["trainer"], run["args"], world)
    if world > 1 and device == "cpu":
        # DeepSpeed on CPUs: without a backend named, accelerate finds none and counts one process while
        # DeepSpeed's group has them all (each process would train on all the data).
        run_args = {**run_args, "ddp_backend": "gloo"}
        if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # accelerate's launch, for zero2 and zero3
            skip_deepspeed_inference_ops()
    if world > 1:
        log.info("%s: %d processes (%s): %s", run["name"], world, "gloo on CPUs" if device == "cpu" else "nccl on GPUs",
                 batch["note"])
    args = build_args(run["trainer"], run_args, **build)
    if run.get("max_tokens"):
        steps = steps_for_tokens(run["max_tokens"], args, lengths, world, bool(batching.get("packing")), lengths_file)
        log.info("%s: max_tokens %d: at most %d steps (the schedule's length), stopping at the step whose tokens "
                 "reach it", run["name"], run["max_tokens"], steps)
        run_args = {**run_args, "max_steps": steps}
        args = build_args(run["trainer"], run_args, **build)
    if args.bf16 and device == "cpu":
        log.info("%s: bf16 (weights and autocast): this CPU's oneDNN has bf16 matrix units (AVX512-BF16 or AMX)",
                 run["name"])
    checkpointing = args.activation_checkpointing
    if not {"activation_checkpointing", "gradient_checkpointing"} & set(run["args"]):
        checkpointing, why = choose_checkpointing(model_dir, forward_tokens(spec, args, lengths["max_length"]),
                                                  2 if args.bf16 else 4, free_bytes(device))
        log.info("%s: activation checkpointing %s: %s", run["name"], "on" if checkpointing else "off", why)
        if checkpointing != args.activation_checkpointing:
            args = build_args(run["trainer"], {**run_args, "activation_checkpointing": checkpointing}, **build)
    inputs = {"model": model_dir, "train": train_file, "eval": eval_file, "lengths": lengths_file,
              "reward_model": reward_dir}
    hashes = {name: hash_path(path) for name, path in inputs.items() if path}
    samples = checkpoint_dir / "training_samples.jsonl"  # survives a crash; a resume keeps earlier steps' rows
    # Resume only a cut-short attempt of the same config and inputs, from its newest complete checkpoint (the log
    # says which and why); a diverged one stops here, before loading.
    parts = {"config": _fingerprint(run), **hashes}
    attempt = Attempt(checkpoint_dir, parts, run["name"])
    resume = attempt.resume

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, set_seed

    if threads:
        torch.set_num_threads(threads)
    set_seed(run["seed"])
    entry = run["model_entry"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=entry.get("trust_remote_code", False))
    sharded = run["distributed"] in SHARDED and world > 1
    routed = routes_attention(model_dir, spec.model_class, entry.get("trust_remote_code", False))
    attention, why = choose_attention(spec, entry, device, routed, run["model"])
    log.info("%s: attention %s: %s", run["name"], attention or "sdpa", why)
    model = load_model(model_dir, run["model"], {**entry, "attn_implementation": attention}, args.bf16,
                       spec.task_type, sharded=sharded)
    prepare_tokenizer(tokenizer, model, padding_side="left" if spec.tokenized else None)
    check_lora_targets(model, run["lora"]["target_modules"], run["model"])
    labelled, why = choose_labelled(run["trainer"], run["args"], device, model, run["lora"], tiny)
    if why:
        log.info("%s: loss: %s", run["name"], why)
    if labelled and run["trainer"] == "sft":
        args.loss_type = "chunked_nll"  # TRL patches the model's forward for it when the trainer is built
        use_one_pass()
    # a copy: peft appends its task's head names to modules_to_save, and `run` is fingerprinted
    peft_config = LoraConfig(task_type=spec.task_type, **copy.deepcopy(run["lora"]))
    extra = trainer_kwargs(spec, run, tokenizer, reward_dir, args.bf16)

    train_ds, eval_ds = (Dataset.from_list(rows) for rows in run_rows(run, spec, tokenizer, train_file, eval_file))
    if batching.get("length_column_name"):
        train_ds, eval_ds = (with_lengths(ds, tokenizer, spec.layout, args.length_column_name)
                             for ds in (train_ds, eval_ds))
    counter = TokenCounter(tokenizer.pad_token_id)
    budget = [TokenBudget(counter, run["max_tokens"])] if run.get("max_tokens") else []
    guard = DivergenceGuard(run["name"], run["trainer"], checkpoint_dir, loss_scaling=args.fp16)
    trainer_cls = load(spec.trainer)
    if batching.get("train_sampling_strategy") == "group_by_length":
        from snaketrl.train.sampler import with_grouped_sampler

        trainer_cls = with_grouped_sampler(trainer_cls, batch.get("group_rows"))
    with answering_trl_flash_warnings(attention, run["name"]):
        trainer = trainer_cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                              processing_class=tokenizer, peft_config=peft_config,
                              callbacks=[counter, *budget, guard, attempt, *(callbacks or [])], **extra)
    counter.watch(trainer)  # FLOPs of its reference, reward and value models too
    if budget and world > 1:
        budget[0].reduce = lambda n: trainer.accelerator.reduce(
            torch.tensor(n, device=trainer.accelerator.device), "sum").item()
    if split and sharded:  # FSDP and ZeRO-3 gather each layer's weights per forward: keep TRL's one pass
        log.warning("%s: row groups are off under %s; TRL pads each batch's rows together", run["name"],
                    run["distributed"])
        split = False
    elif split and args.use_liger_kernel and spec.layout == "preference":
        # TRL's fused Liger losses of preference trainers run the decoder themselves, never the model's forward
        log.warning("%s: row groups are off under use_liger_kernel; TRL's fused loss pads each batch's rows "
                    "together", run["name"])
        split = False
    if labelled and run["trainer"] == "dpo":
        completion_logits(trainer, row_groups=split)  # the row groups between its two layers of the forward
    elif split:
        split_model_rows(trainer)
    # varlen attends within sequences it is told of: a padded batch's layers can then skip the padding
    unpadded = attention == "varlen" and not batching.get("packing")
    if unpadded:
        from snaketrl.train.cost import decoder

        unpad(decoder(trainer.model))
    # Packed datasets hold sequences of several examples: nothing to count there (and TRL drops none).
    dropped = len(train_ds) - len(trainer.train_dataset) if spec.drops and not batching.get("packing") else None

    attempt.attach(trainer, counter, training_samples.attach(trainer, samples, run["name"]))
    imports_done()
    try:
        metrics = dict(trainer.train(resume_from_checkpoint=resume).metrics)
    except RuntimeError as err:
        guard.failed(err)
        raise
    # A diverged run stops here, before any output exists; its checkpoints and log stay in checkpoint_dir.
    guard.check(metrics)
    check_trained(trainer.state, args, run["name"], len(train_ds))
    attempt.combine(metrics, trainer.state)  # the whole run's time, over every attempt
    metrics.update(counter.summary(gather_steps(counter.steps, world)))
    metrics.update(device=device, batching=choice.get("strategy", "padded"), row_groups=bool(split),
                   activation_checkpointing=bool(checkpointing), attn_implementation=attention or "sdpa",
                   unpadded=unpadded, logits_on_labels_only=labelled)
    if dropped is not None:
        metrics["examples_dropped"] = dropped
    if run.get("max_tokens"):
        metrics.update(max_tokens=run["max_tokens"], max_steps=args.max_steps, steps=trainer.state.global_step)
        log.info("%s: %d real tokens in %d of at most %d steps (max_tokens %d)", run["name"], metrics["real_tokens"],
                 trainer.state.global_step, args.max_steps, run["max_tokens"])
    if world > 1:
        metrics.update(group_metrics(trainer, batch))
    if spec.evaluates:
        metrics.update(trainer.evaluate())
        guard.check(metrics)

    out_dir = Path(out_dir)
    main = trainer.is_world_process_zero()
    # Collective under accelerate (ZeRO-3 gathers the shards): every rank saves into the one folder rank 0
    # made, which rank 0 alone then puts in place.
    tag = "-ranks" if world > 1 else None
    shared = out_dir / f".adapter.tmp{tag}"
    with atomic(out_dir / "adapter", directory=True, tag=tag) if main else nullcontext(shared) as adapter_tmp:
        trainer.accelerator.wait_for_everyone()
        trainer.save_model(str(adapter_tmp))
        trainer.accelerator.wait_for_everyone()
        if main:
            tokenizer.save_pretrained(str(adapter_tmp))
    if not main:
        return metrics
    with atomic(out_dir / "trainer_state.json") as tmp:
        trainer.state.save_to_json(str(tmp))
    kill_point("writing_outputs")
    write_json(metrics, out_dir / "metrics.json")
    training_samples.finish(samples, out_dir / "training_samples.jsonl")
    manifest.write(out_dir / "manifest.json", resolved=run, trl_args=args.to_dict(),
                   inputs={name: {"path": str(inputs[name]), "sha256": h} for name, h in hashes.items()},
                   device=device, resumed_from=resume, model_source=read_source(model_dir), attempts=attempt.attempts,
                   numerics=manifest.numerics("bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"))
    attempt.finish()
    return metrics


def group_metrics(trainer, batch: dict) -> dict:
    """How a launched run trained: its processes and global batch (args.split_batch), the accelerate mode, the
    backend, DeepSpeed's ZeRO stage."""
    import torch.distributed as dist

    plugin = trainer.accelerator.state.deepspeed_plugin
    return {"processes": batch["processes"], "global_batch": batch["global_batch"], "global_batch_note": batch["note"],
            "distributed_type": str(trainer.accelerator.distributed_type.value), "backend": dist.get_backend(),
            **({"zero_stage": plugin.zero_stage} if plugin is not None else {})}


def gather_steps(steps: list[dict], world: int) -> list[dict]:
    """The per-step token and FLOP records of every process, added up step by step (a collective: every rank
    calls it); one process's own."""
    if world == 1:
        return steps
    import torch.distributed as dist

    from snaketrl.train.tokens import combine_ranks

    every: list = [None] * world
    dist.all_gather_object(every, steps)
    return combine_ranks(every)


def init_group(run: dict) -> None:
    """A launched CPU process's gloo group, made before transformers makes it: transformers passes `ddp_timeout`
    to the process group on GPUs only, and gloo's default of 30 minutes would keep a rank waiting that long
    for a peer that hangs."""
    from datetime import timedelta

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("ACCELERATE_USE_CPU") == "true" \
            and not dist.is_initialized():
        timeout = run["args"].get("ddp_timeout", 1800)
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))


def main(argv=None) -> None:
    """The launched processes (`python -m snaketrl.train JOB.json [JOB.json ...]`): each trains the jobs in
    turn, in one process group (several jobs share one launch's start-up: imports take most of a tiny job's
    time). An error ends the process with one line naming its rank (snaketrl.train.distributed.failure_line
    quotes it)."""
    import sys
    import traceback

    from snaketrl.errors import SnaketrlError
    from snaketrl.smk import _one_line
    from snaketrl.train.distributed import RANK_ERROR

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    try:
        for path in argv or sys.argv[1:]:
            job = json.loads(Path(path).read_text())
            init_group(job["run"])
            train_run(**job)
    except Exception as err:
        if not isinstance(err, SnaketrlError):
            traceback.print_exc()
        message = str(err) if isinstance(err, SnaketrlError) else f"{type(err).__name__}: {err}"
        print(f"{RANK_ERROR}{rank}: {_one_line(message, 300)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
