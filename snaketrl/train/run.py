"""The train job: one resolved run with its TRL trainer, LoRA/QLoRA, resumable checkpoints.

train_run reads top to bottom as TRL's scripts do: plan (snaketrl.train.plan) -> resume -> load -> build the
trainer -> train -> check -> write the outputs.
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
from snaketrl.errors import ConfigError, TrainingError, one_line
from snaketrl.imports import imports_done, skip_deepspeed_inference_ops
from snaketrl.io import atomic, hash_path, read_jsonl, write_json
from snaketrl.kill_points import kill_point
from snaketrl.manifest import code_hash
from snaketrl.models import chat_template
from snaketrl.models.gguf import read_source
from snaketrl.models.tokenizer import prepare_tokenizer
from snaketrl.processes import give_back_freed_memory
from snaketrl.train import live, training_samples
from snaketrl.train.attention import answering_trl_flash_warnings, unpad
from snaketrl.train.generation import compile_decode, merge_for_generation, merge_rows_for_generation
from snaketrl.train.head import contiguous_head
from snaketrl.train.labelled import choose as choose_labelled
from snaketrl.train.labelled import completion_logits, use_one_pass
from snaketrl.train.loading import check_lora_targets, check_reward_tokenizer, load_model
from snaketrl.train.logps import TRAINERS as CHUNKED_COMPLETIONS
from snaketrl.train.logps import chunk_completion_logits
from snaketrl.train.packed import pack_for_generation
from snaketrl.train.prefill import dedupe_prefill
from snaketrl.train.scored import TRAINERS, bound_logits
from snaketrl.train.plan import TrainPlan, detect_device, plan_run
from snaketrl.train.sampling import sample_by_inverse_cdf
from snaketrl.trainers import load

log = logging.getLogger("snaketrl.train")


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def train_run(run: dict, *, model_dir, train_file, eval_file, lengths_file, out_dir, checkpoint_dir,
              reward_dir=None, threads: int | None = None, callbacks=None, mem_mb: int | None = None) -> dict:
    """Train one resolved run (snaketrl.config.resolve.resolve_run); write adapter/, trainer_state.json, metrics.json
    and manifest.json into out_dir, each whole or not at all. `mem_mb`: this process's share of the train rule's
    mem_mb resource, which bounds the plan's memory on a CPU."""
    import torch
    from transformers import AutoTokenizer, set_seed

    from snaketrl.train.checkpoints import Attempt
    from snaketrl.train.guard import DivergenceGuard
    from snaketrl.train.tokens import FlopBudget, TokenBudget, TokenCounter

    # Plan: everything the job decides from its config, its input files, the device and the process group, before
    # any model loads (snaketrl.train.plan).
    world = int(os.environ.get("WORLD_SIZE", "1"))  # launched (snaketrl.train.distributed): `world` processes
    device = detect_device(mem_mb)
    if world > 1 and device.name == "cpu" and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        skip_deepspeed_inference_ops()  # accelerate's zero2 and zero3: before the training arguments are built
    plan = plan_run(run, model_dir=model_dir, lengths_file=lengths_file, train_file=train_file,
                    checkpoint_dir=checkpoint_dir, device=device, world=world, reward_dir=reward_dir)
    for note in plan.notes:
        log.info("%s: %s", run["name"], note)
    spec, args, entry = plan.spec, plan.args, run["model_entry"]
    if spec.generates:  # steps of new shapes: a kept heap would fragment and grow (snaketrl.processes)
        give_back_freed_memory()

    # Resume only a cut-short attempt of the same config, inputs and code, from its newest complete checkpoint (the
    # log says which and why); a diverged one stops here, before loading.
    inputs = {"model": model_dir, "train": train_file, "eval": eval_file, "lengths": lengths_file,
              "reward_model": reward_dir}
    hashes = {name: hash_path(path) for name, path in inputs.items() if path}
    attempt = Attempt(checkpoint_dir, {"config": fingerprint(run), "code": code_hash(), **hashes}, run["name"])

    # Load the tokenizer and the policy as planned; the loss choice needs the loaded model.
    if threads:
        torch.set_num_threads(threads)
    set_seed(run["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=entry.get("trust_remote_code", False))
    model = load_model(model_dir, run["model"], {**entry, "attn_implementation": plan.attention}, args.bf16,
                       spec.task_type, sharded=plan.sharded)
    prepare_tokenizer(tokenizer, model, padding_side="left" if spec.tokenized else None)
    check_lora_targets(model, run["lora"]["target_modules"], run["model"])
    # The rows of tokens a chat template added train too (the model directory records them).
    lora = chat_template.trainable_tokens(model, model_dir, run["lora"])
    labelled, why = choose_labelled(run["trainer"], run["args"], plan.device, model, lora, "tiny" in entry)
    if why:
        log.info("%s: loss: %s", run["name"], why)

    # Build the trainer, with the workflow's callbacks and its forward as planned.
    train_ds, eval_ds = datasets(plan, tokenizer, train_file, eval_file)
    counter = TokenCounter(tokenizer.pad_token_id)
    budget = [*([TokenBudget(counter, run["max_tokens"])] if run.get("max_tokens") else []),
              *([FlopBudget(counter, run["max_flops"])] if run.get("max_flops") else [])]
    guard = DivergenceGuard(run["name"], run["trainer"], checkpoint_dir, loss_scaling=args.fp16)
    trainer = build_trainer(plan, model, tokenizer, train_ds, eval_ds, labelled, reward_dir, lora,
                            callbacks=[counter, *budget, guard, attempt, *(callbacks or [])])
    counter.watch(trainer)  # FLOPs of its reference, reward and value models too
    for kept in budget if world > 1 else []:
        kept.reduce = lambda n: trainer.accelerator.reduce(
            torch.tensor(n, device=trainer.accelerator.device), "sum").item()
    attempt.attach(trainer, counter, training_samples.attach(trainer, attempt.samples, run["name"]))

    # Train.
    imports_done()
    try:
        metrics = dict(trainer.train(resume_from_checkpoint=attempt.resume).metrics)
    except RuntimeError as err:
        guard.failed(err)
        raise

    # Check: a diverged run stops here, before any output exists (its checkpoints and log stay in
    # checkpoint_dir); so does one that made no optimizer step.
    guard.check(metrics)
    check_trained(trainer.state, args, run["name"], len(train_ds))
    attempt.combine(metrics, trainer.state)  # the whole run's time, over every attempt
    metrics.update(counter.summary(gather_steps(counter.steps, world)))
    metrics.update(plan.report(), logits_on_labels_only=labelled)
    # Packed datasets hold sequences of several examples: nothing to count there (and TRL drops none).
    if spec.drops and not plan.packed:
        metrics["examples_dropped"] = len(train_ds) - len(trainer.train_dataset)
    if run.get("max_tokens"):
        metrics.update(max_tokens=run["max_tokens"], max_steps=args.max_steps, steps=trainer.state.global_step)
        log.info("%s: %d real tokens in %d of at most %d steps (max_tokens %d)", run["name"], metrics["real_tokens"],
                 trainer.state.global_step, args.max_steps, run["max_tokens"])
    if run.get("max_flops"):
        flop_budget = budget[-1]
        metrics.update(max_flops=run["max_flops"], max_flops_reached_at=flop_budget.reached_at,
                       steps=trainer.state.global_step)
        if flop_budget.reached_at is None:
            log.warning("%s: the schedule ended at step %d with %.3g FLOPs, before max_flops %.3g: raise max_steps "
                        "(or num_train_epochs) to spend the budget", run["name"], trainer.state.global_step,
                        metrics["flops"], run["max_flops"])
    if world > 1:
        metrics.update(group_metrics(trainer, plan.batch))
    if spec.evaluates:
        metrics.update(trainer.evaluate())
        live.finish(args)  # its records in the live view's store before the job ends
        guard.check(metrics)

    # Write the outputs, each whole or not at all.
    if write_outputs(trainer, tokenizer, plan, metrics, Path(out_dir), attempt,
                     {name: {"path": str(inputs[name]), "sha256": h} for name, h in hashes.items()}, model_dir):
        attempt.finish()
    return metrics


def datasets(plan: TrainPlan, tokenizer, train_file, eval_file):
    """The run's train and eval datasets; with each example's tokens in the length column where the planned
    batching groups by a column (snaketrl.train.sampler)."""
    from datasets import Dataset

    run, spec = plan.run, plan.spec
    train_ds, eval_ds = (Dataset.from_list(rows) for rows in run_rows(run, spec, tokenizer, train_file, eval_file))
    check_ppo_batch(plan, len(train_ds), train_file)
    if plan.batching.get("length_column_name"):
        train_ds, eval_ds = (with_lengths(ds, tokenizer, spec.layout, plan.args.length_column_name)
                             for ds in (train_ds, eval_ds))
    return train_ds, eval_ds


def check_ppo_batch(plan: TrainPlan, rows: int, train_file) -> None:
    """PPO's loop draws whole batches (TRL's loader drops a short one) from an endless repeat of its loader: with
    fewer prompts than one batch it would wait forever, so it stops here in one line."""
    args = plan.args
    need = args.per_device_train_batch_size * args.gradient_accumulation_steps * plan.world
    if plan.run["trainer"] == "ppo" and rows < need:
        processes = f" x {plan.world} processes" if plan.world > 1 else ""
        raise ConfigError(f"{train_file}: {rows} prompts for run '{plan.run['name']}', fewer than one PPO batch of "
                          f"{need} (per_device_train_batch_size {args.per_device_train_batch_size} x "
                          f"gradient_accumulation_steps {args.gradient_accumulation_steps}{processes}): lower the "
                          f"batch or give datasets.{plan.run['dataset']} more rows")


def build_trainer(plan: TrainPlan, model, tokenizer, train_ds, eval_ds, labelled: bool, reward_dir, lora: dict,
                  callbacks: list):
    """The run's TRL trainer with its LoRA adapter (`lora`: the run's, with the rows of tokens its chat template
    added), and its forward as planned: one-pass SFT loss or DPO's completion logits where `labelled`, row groups,
    unpadded varlen layers, merged generation (the adapter, the trained token rows), the reward model's reading,
    compiled decode."""
    from peft import LoraConfig

    run, spec, args = plan.run, plan.spec, plan.args
    if labelled and run["trainer"] == "sft":
        args.loss_type = "chunked_nll"  # TRL patches the model's forward for it when the trainer is built
        use_one_pass()
    elif run["trainer"] == "sft" and chat_template.trains_head_rows(model, lora):
        if run["args"].get("loss_type") == "chunked_nll":
            raise ConfigError(f"run '{run['name']}': loss_type chunked_nll reads the output projection's weight "
                              f"itself and would miss the rows trained for the tokens models.{run['model']}."
                              f"chat_template added; use loss_type nll (or leave it unset)")
        args.loss_type = run["args"].get("loss_type", "nll")  # TRL's default, chunked_nll, would fail there
    # a copy: peft appends its task's head names to modules_to_save, and `run` is fingerprinted
    peft_config = LoraConfig(task_type=spec.task_type, **copy.deepcopy(lora))
    extra = trainer_kwargs(spec, run, tokenizer, reward_dir, args.bf16)
    trainer_cls = load(spec.trainer)
    if plan.batching.get("train_sampling_strategy") == "group_by_length":
        from snaketrl.train.sampler import with_grouped_sampler

        trainer_cls = with_grouped_sampler(trainer_cls, plan.batch.get("group_rows"))
    with answering_trl_flash_warnings(plan.attention, run["name"]):
        trainer = trainer_cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                              processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks, **extra)
    if run["trainer"] in TRAINERS and not plan.sharded:  # sharded weights are gathered by module hooks
        bound_logits(trainer, run["trainer"])  # within DPO's tails (below): TRL's path unless logits exceed a chunk
    if labelled and run["trainer"] == "dpo":
        completion_logits(trainer, row_groups=plan.row_groups)  # the row groups between its two layers
    elif plan.row_groups:
        from snaketrl.train.batching import split_rows

        for module in (trainer.model, getattr(trainer, "ref_model", None)):  # and a separate reference model
            if module is not None:
                split_rows(module, args.pad_to_multiple_of)
    if run["trainer"] in CHUNKED_COMPLETIONS and not plan.sharded:  # sharded weights are gathered by module hooks
        chunk_completion_logits(trainer)  # TRL's path unless a batch's completion logits exceed a chunk
    if run["trainer"] == "ppo" and not plan.sharded:
        from snaketrl.train.ppo import bound_logits as bound_ppo_logits

        bound_ppo_logits(trainer)  # TRL's path unless an update's logits exceed a chunk
    if plan.reward_read_as_trained:
        from snaketrl.train.reward_reading import read_as_trained

        read_as_trained(trainer)  # plain prompts: the reward model reads them with eos, as trained
    if run["trainer"] == "ppo" and run.get("chat", False):
        from snaketrl.train.ppo import score_to_turn_end

        score_to_turn_end(trainer)  # the reward model reads a completion to its turn's end, as it was trained
    if plan.unpadded:
        from snaketrl.train.cost import decoder

        unpad(decoder(trainer.model))
    for module in (trainer.model, getattr(trainer, "ref_model", None), getattr(trainer, "policy_model", None)):
        if module is not None:
            contiguous_head(module)  # the same logits, without a batch-sized copy of the head (snaketrl.train.head)
    if plan.merged_generation:
        merge_for_generation(trainer, run["trainer"])
    if plan.inverse_cdf_sampling:
        sample_by_inverse_cdf(trainer, run["trainer"])
    if plan.packed_generation:
        pack_for_generation(trainer, run["trainer"])
    if plan.deduped_prefill:
        dedupe_prefill(trainer, run["trainer"])
    if plan.merged_token_rows:
        # outermost, so that generation's packed copies (packed.py) are of the merged rows
        merge_rows_for_generation(trainer, run["trainer"])
    if plan.compiled_decode:
        compile_decode(trainer, plan.compiled_decode, plan.device)
    return trainer


def write_outputs(trainer, tokenizer, plan: TrainPlan, metrics: dict, out_dir: Path, attempt, inputs: dict,
                  model_dir) -> bool:
    """adapter/, trainer_state.json, metrics.json, training_samples.jsonl and manifest.json, each whole or not at
    all. Collective under accelerate (ZeRO-3 gathers the shards): every rank saves into the one folder rank 0
    made, which rank 0 alone then puts in place and completes. Whether this process wrote them (rank 0)."""
    from snaketrl import manifest

    run, args = plan.run, plan.args
    main = trainer.is_world_process_zero()
    tag = "-ranks" if plan.world > 1 else None
    shared = out_dir / f".adapter.tmp{tag}"
    with atomic(out_dir / "adapter", directory=True, tag=tag) if main else nullcontext(shared) as adapter_tmp:
        trainer.accelerator.wait_for_everyone()
        trainer.save_model(str(adapter_tmp))
        trainer.accelerator.wait_for_everyone()
        if main:
            tokenizer.save_pretrained(str(adapter_tmp))
    if not main:
        return False
    with atomic(out_dir / "trainer_state.json") as tmp:
        trainer.state.save_to_json(str(tmp))
    kill_point("writing_outputs")
    write_json(metrics, out_dir / "metrics.json")
    training_samples.finish(attempt.samples, out_dir / "training_samples.jsonl")
    manifest.write(out_dir / "manifest.json", resolved=run, trl_args=args.to_dict(), inputs=inputs,
                   device=plan.device, plan={**plan.report(), "notes": list(plan.notes)},
                   resumed_from=attempt.resume, model_source=read_source(model_dir),
                   chat_template=chat_template.read_record(model_dir),
                   attempts=attempt.attempts,
                   numerics=manifest.numerics("bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"))
    return True


def trainer_kwargs(spec, run: dict, tokenizer, reward_dir, bf16: bool) -> dict:
    """What a trainer takes beyond model/args/data: reward functions, or PPO's reward and value models."""
    trust = run.get("reward_trust_remote_code", False)  # the reward run's model entry's
    if spec.reward_funcs:
        from snaketrl.rewards import resolve

        funcs = resolve(run["reward_funcs"])
        if reward_dir:
            check_reward_tokenizer(tokenizer, reward_dir, run["name"], trust)
            funcs.append(str(reward_dir))  # TRL loads it with its own tokenizer (args.trust_remote_code: the plan's)
        return {"reward_funcs": funcs}
    if spec.value_model:
        check_reward_tokenizer(tokenizer, reward_dir, run["name"], trust)
        entry = {"trust_remote_code": trust}
        # The value model starts as a copy of the reward model; the reference is the adapter-free policy.
        return {"reward_model": load_model(reward_dir, "reward", entry, bf16, "SEQ_CLS"),
                "value_model": load_model(reward_dir, "value", entry, bf16, "SEQ_CLS"),
                "ref_model": None}
    return {}


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
    from snaketrl.train.distributed import RANK_ERROR

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    try:
        for path in argv or sys.argv[1:]:
            job = json.loads(Path(path).read_text())
            init_group(job["run"])
            train_run(**job)
        # Every rank done before any tears its group down: a gloo rank whose peer exited first can abort
        # (SIGABRT) in its own teardown, after the outputs were written, and fail the job.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception as err:
        if not isinstance(err, SnaketrlError):
            traceback.print_exc()
        message = str(err) if isinstance(err, SnaketrlError) else f"{type(err).__name__}: {err}"
        print(f"{RANK_ERROR}{rank}: {one_line(message, 300)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
