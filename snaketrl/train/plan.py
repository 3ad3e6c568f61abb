"""What a train job decides before any model loads, decided once: the plan.

From the resolved run (its config), the length stage's file, the train file's first row, the reward model's
presence, the device and the process group, `plan_run`
decides the batching, the processes' split of the batch, the TRL args (built once: steps from `max_tokens`,
activation checkpointing from memory, bf16 from the hardware), the attention, row groups, unpadding, merged
generation and compiled decode, the trained token rows merged for generation, and how a reward model reads plain
prompts. The train job then loads, builds and trains as planned (snaketrl.train.run); the
manifest and metrics.json report the plan. Only the loss choice waits for the loaded model
(snaketrl.train.labelled.choose).

No torch import here: the device's facts come in as a `Device` (`detect_device` reads them from torch).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from snaketrl.errors import TrainingError
from snaketrl.data.chat import as_chat
from snaketrl.models.chat_template import trains_added_rows, trains_token_rows
from snaketrl.train import live
from snaketrl.train.args import (check_args, check_hardware, check_liger_model, check_switches, split_batch,
                                 steps_for_tokens, trl_kwargs)
from snaketrl.train.attention import choose as choose_attention
from snaketrl.train.attention import routes_attention
from snaketrl.train.distributed import SHARDED
from snaketrl.train.generation import COMPILES, GENERATES, static_cache_len
from snaketrl.train.logps import TRAINERS as CHUNKED_COMPLETIONS
from snaketrl.train.logps import projection_alone
from snaketrl.train.memory import choose_checkpointing, keeps_freed_memory, trained_state_bytes, weight_bytes
from snaketrl.train.scored import plans_chunks
from snaketrl.trainers import REGISTRY, Trainer, load

log = logging.getLogger("snaketrl.train")


@dataclasses.dataclass(frozen=True)
class Device:
    """The facts of the device a job trains on that decide its plan."""

    name: str  # "cuda" or "cpu"
    bf16_units: bool  # computes bf16 natively (a bf16 GPU; a CPU with AVX512-BF16 or AMX)
    free_bytes: int  # free memory before loading
    limit_bytes: int | None = None  # the job's own memory limit, on a CPU (snaketrl.train.memory.memory_limit_bytes)
    limit_source: str = ""  # what sets it


def detect_device(mem_mb: int | None = None) -> Device:
    """This process's device: CUDA where visible, else the CPU. `mem_mb`: the train rule's mem_mb resource, which
    with the process's cgroup limit bounds a CPU's room (a GPU's is its own memory)."""
    import torch

    from snaketrl.train.args import native_bf16
    from snaketrl.train.memory import free_bytes, memory_limit_bytes

    name = "cuda" if torch.cuda.is_available() else "cpu"
    limit, source = memory_limit_bytes(mem_mb) if name == "cpu" else (None, "")
    return Device(name, native_bf16(cpu=True), free_bytes(name), limit, source)


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """Everything a train job decides before loading; `notes` say why, one log line each."""

    run: dict
    spec: Trainer
    device: str
    world: int  # processes training together
    batch: dict  # the global batch as the processes split it (args.split_batch)
    max_length: int
    choice: dict  # the length stage's batching choice for this device
    args: Any  # the TRL config
    checkpointing: bool
    attention: str | None  # None: transformers' default (sdpa)
    sharded: bool  # FSDP or ZeRO-3 across processes
    row_groups: bool  # each batch's rows run in length groups (snaketrl.train.batching)
    unpadded: bool  # varlen layers skip a padded batch's padding (snaketrl.train.attention.unpad)
    merged_generation: bool = False  # generation runs with the LoRA adapter merged (snaketrl.train.generation)
    inverse_cdf_sampling: bool = False  # generation draws its tokens by the inverse CDF (snaketrl.train.sampling)
    packed_generation: bool = False  # generation's bf16 linear layers run on prepacked weights (snaketrl.train.packed)
    deduped_prefill: bool = False  # generation prefills each distinct prompt once (snaketrl.train.prefill)
    # generation runs with the trained token rows merged (snaketrl.train.generation.merge_rows_for_generation)
    merged_token_rows: bool = False
    # the reward model reads plain prompts with eos, as trained (snaketrl.train.reward_reading)
    reward_read_as_trained: bool = False
    # positions of the static KV cache a compiled decode runs on (snaketrl.train.generation.compile_decode); 0: eager
    compiled_decode: int = 0
    # what the checkpointing choice compared, where memory decided it (snaketrl.train.memory.choose_checkpointing)
    memory: dict = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def batching(self) -> dict:
        """The TRL fields the length stage's choice sets."""
        return self.choice.get("args", {})

    @property
    def packed(self) -> bool:
        return bool(self.batching.get("packing"))

    def report(self) -> dict:
        """What metrics.json says of the plan."""
        return {"device": self.device, "batching": self.choice.get("strategy", "padded"), "row_groups": self.row_groups,
                "activation_checkpointing": self.checkpointing, "attn_implementation": self.attention or "sdpa",
                "unpadded": self.unpadded, **({"merged_generation": True} if self.merged_generation else {}),
                **({"inverse_cdf_sampling": True} if self.inverse_cdf_sampling else {}),
                **({"packed_generation": True} if self.packed_generation else {}),
                **({"deduped_prefill": True} if self.deduped_prefill else {}),
                **({"merged_token_rows": True} if self.merged_token_rows else {}),
                **({"reward_read_as_trained": True} if self.reward_read_as_trained else {}),
                **({"compiled_decode": {"max_cache_len": self.compiled_decode}} if self.compiled_decode else {}),
                **self.memory}


def batching_choice(lengths: dict, device: str, lengths_file) -> dict:
    """The length stage's choice for this device; a histogram written before it chose one gets TRL's default."""
    choice = lengths.get("batching_by_device", {}).get(device)
    if choice is None and "batching" in lengths:  # an older histogram's: a CPU's choice (row groups)
        if device != "cpu":
            raise TrainingError(f"{lengths_file}: no batching choice for {device}, only a CPU's ('batching', from "
                                f"an older snaketrl); rerun the histogram: snakemake --forcerun length_histogram")
        choice = lengths["batching"]
    return choice or {}


def forward_tokens(spec: Trainer, fields, max_length: int) -> int:
    """Tokens of one training forward at most: rows (a preference pair is two; online DPO's two completions of a
    prompt) x their longest; an online trainer's rows are a prompt (cut to max_length) and its completion. `fields`:
    the TRL config's values."""
    rows = fields.per_device_train_batch_size * (2 if spec.layout == "preference" else spec.completions_per_prompt)
    completion = completion_tokens(fields)
    return rows * (max_length + (completion if spec.length_field is None else 0))


def completion_tokens(fields) -> int:
    """Tokens an online trainer's completion runs to at most (GRPO's, RLOO's, PPO's or online DPO's field); 0 for
    an offline one."""
    return (getattr(fields, "max_completion_length", None) or getattr(fields, "response_length", None)
            or getattr(fields, "max_new_tokens", None) or 0)


def projected_tokens(trainer: str, spec: Trainer, fields, max_length: int) -> int:
    """Positions whose logits one training step computes (snaketrl.train.memory counts them): none for a
    classifier's score head; ORPO's one and a half times every position (its NLL term takes a log-softmax of the
    chosen rows' logits again); GRPO's and RLOO's completion positions (snaketrl.train.logps: transformers'
    logits_to_keep spares the prompts); every position otherwise."""
    if spec.task_type == "SEQ_CLS":
        return 0
    if trainer in CHUNKED_COMPLETIONS:
        return fields.per_device_train_batch_size * fields.max_completion_length
    every = forward_tokens(spec, fields, max_length)
    return every * 3 // 2 if trainer == "orpo" else every


def plan_run(run: dict, *, model_dir, lengths_file, train_file, checkpoint_dir, device: Device, world: int = 1,
             reward_dir=None) -> TrainPlan:
    """The plan of one resolved run (snaketrl.config.resolve.resolve_run) on `device`, as one of `world` processes,
    training on `train_file` (with the reward model in `reward_dir`, where it has one). Refuses, before any model
    loads, what cannot run."""
    spec = REGISTRY[run["trainer"]]
    name, entry = run["name"], run["model_entry"]
    lengths = json.loads(Path(lengths_file).read_text())
    choice = batching_choice(lengths, device.name, lengths_file)
    batching = choice.get("args", {})
    notes, memory = [], {}

    # Checks: a misspelt field is named before a missing GPU.
    check_args(run["trainer"], run["args"], name)
    check_switches(run["trainer"], run["args"], f"run '{name}'", run["model"], entry)
    check_hardware(run["args"], name, run["model"], entry, cuda=device.name == "cuda")
    if device.name == "cuda":
        check_liger_model(run["args"], model_dir, name, run["model"])

    # The processes' split of the configured (global) batch; the live view's fields, which the job's environment
    # carries (snaketrl.train.live).
    run_args, batch = split_batch(run["trainer"], {**run["args"], **live.fields(name)}, world)
    if world > 1 and device.name == "cpu":
        # DeepSpeed on CPUs: without a backend named, accelerate finds none and counts one process while
        # DeepSpeed's group has them all (each process would train on all the data).
        run_args = {**run_args, "ddp_backend": "gloo"}
    if world > 1:
        notes.append(f"{world} processes ({'gloo on CPUs' if device.name == 'cpu' else 'nccl on GPUs'}): "
                     f"{batch['note']}")

    # The TRL args. A tiny model's numbers (learning checks, thresholds) are measured in fp32, and its 64-wide
    # layers gain nothing from bf16 units: it trains in bf16 on a bf16 GPU only; a real model also on a CPU
    # with bf16 matrix units.
    cls = load(spec.config)
    bf16 = device.bf16_units and (device.name == "cuda" or "tiny" not in entry)
    kwargs = trl_kwargs(run["trainer"], run_args, output_dir=str(checkpoint_dir), max_length=lengths["max_length"],
                        seed=run["seed"], run=name, batching=batching, bf16=bf16, cuda=device.name == "cuda")
    if run.get("reward_trust_remote_code") and spec.reward_funcs:
        kwargs["trust_remote_code"] = True  # TRL loads the reward model from its path with it
    fields = SimpleNamespace(**{**{f.name: f.default for f in dataclasses.fields(cls) if f.init}, **kwargs})
    if run.get("max_tokens"):
        steps = steps_for_tokens(run["max_tokens"], fields, lengths, world, bool(batching.get("packing")),
                                 lengths_file)
        notes.append(f"max_tokens {run['max_tokens']}: at most {steps} steps (the schedule's length), stopping at the "
                     f"step whose tokens reach it")
        kwargs["max_steps"] = steps
    if kwargs["bf16"] and device.name == "cpu":
        notes.append("bf16 (weights and autocast): this CPU's oneDNN has bf16 matrix units (AVX512-BF16 or AMX)")
    # TRL turns checkpointing on for every run; where the config leaves it unset, memory decides.
    if not {"activation_checkpointing", "gradient_checkpointing"} & set(run["args"]):
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        dtype_bytes = 2 if kwargs["bf16"] else 4
        tokens = forward_tokens(spec, fields, lengths["max_length"])
        # PPO loads the reward run's model twice (reward and value model: snaketrl.train.ppo), a trainer judged by a
        # reward model once
        others = weight_bytes(reward_dir) * (2 if spec.value_model else 1) if reward_dir else 0
        checkpointing, why, memory = choose_checkpointing(
            model_dir, tokens, dtype_bytes,
            device.free_bytes, projected_tokens(run["trainer"], spec, fields, lengths["max_length"]),
            upcast_head=run["trainer"] == "sft",
            chunked=(plans_chunks(run["trainer"], fields, run["lora"], model_dir)
                     # snaketrl.train.ppo.bound_logits, snaketrl.train.logps.chunk_completion_logits
                     or ((spec.value_model or run["trainer"] in CHUNKED_COMPLETIONS)
                         and projection_alone(model_config)))
            and not (run["distributed"] in SHARDED and world > 1), value_model=spec.value_model,
            kept=run["trainer"] in CHUNKED_COMPLETIONS, trained_rows=trains_added_rows(model_dir, run["lora"]),
            # online DPO's log-softmax of its completions alone (snaketrl.train.memory)
            completions=(fields.per_device_train_batch_size * spec.completions_per_prompt * completion_tokens(fields)
                         if spec.completions_per_prompt > 1 else None),
            # SFT's count, every position, already bounds a kept heap: its one pass projects the labels alone
            heap_kept=keeps_freed_memory(device.name, spec.generates) and run["trainer"] != "sft",
            trained_state=trained_state_bytes(reward_dir if spec.value_model else None, dtype_bytes),
            other_weights=others, limit=device.limit_bytes, limit_source=device.limit_source)
        notes.append(f"activation checkpointing {'on' if checkpointing else 'off'}: {why}")
        kwargs["activation_checkpointing"] = checkpointing
    args = cls(**kwargs)

    # Attention, and what the model's forward runs in row groups or unpadded.
    trust = entry.get("trust_remote_code", False)
    attention, why = choose_attention(spec, entry, device.name, routes_attention(model_dir, spec.model_class, trust),
                                      run["model"])
    notes.append(f"attention {attention or 'sdpa'}: {why}")
    sharded = run["distributed"] in SHARDED and world > 1
    row_groups = choice.get("split_rows", False)
    if row_groups and sharded:  # FSDP and ZeRO-3 gather each layer's weights per forward: keep TRL's one pass
        notes.append(f"row groups are off under {run['distributed']}; TRL pads each batch's rows together")
        row_groups = False
    elif row_groups and args.use_liger_kernel and spec.layout == "preference":
        # TRL's fused Liger losses of preference trainers run the decoder themselves, never the model's forward
        notes.append("row groups are off under use_liger_kernel; TRL's fused loss pads each batch's rows together")
        row_groups = False
    # varlen attends within sequences it is told of: a padded batch's layers can then skip the padding
    unpadded = attention == "varlen" and not batching.get("packing")
    merged, why = merges_for_generation(run, device.name, args, sharded)
    if merged:
        notes.append(f"generation with the LoRA adapter merged: {why}")
    inverse_cdf, why = samples_by_inverse_cdf(run, device.name, args)
    if inverse_cdf:
        notes.append(f"generation draws its tokens by the inverse CDF: {why}")
    packs, why = packs_for_generation(run, device.name, args, sharded, device.bf16_units)
    if packs:
        notes.append(f"generation's bf16 linear layers on prepacked weights: {why}")
    dedupes, why = dedupes_prefill(run, device.name, args, sharded)
    if dedupes:
        notes.append(f"generation prefills each distinct prompt once: {why}")
    rows_merged, why = merges_token_rows(run, model_dir)
    if rows_merged:
        notes.append(f"generation with the trained token rows merged: {why}")
    reads, why = reward_reads_as_trained(run, train_file, reward_dir)
    if reads:
        notes.append(f"the reward model reads plain prompts with eos: {why}")
    compiles, why = compiles_decode(run, device.name, args, sharded,
                                    planned_generations(args, lengths, world) if run["trainer"] in COMPILES else None)
    cache = cache_positions(lengths, args) if compiles else 0
    if why:
        notes.append(f"decode compiled on a static cache of {cache} positions: {why}" if compiles else
                     f"decode eager: {why}")
    return TrainPlan(run=run, spec=spec, device=device.name, world=world, batch=batch, max_length=lengths["max_length"],
                     choice=choice, args=args, checkpointing=bool(args.activation_checkpointing), attention=attention,
                     sharded=sharded, row_groups=row_groups, unpadded=unpadded, merged_generation=merged,
                     inverse_cdf_sampling=inverse_cdf, packed_generation=packs, deduped_prefill=dedupes,
                     merged_token_rows=rows_merged, reward_read_as_trained=reads, compiled_decode=cache,
                     memory=memory, notes=tuple(notes))


def merges_for_generation(run: dict, device: str, args, sharded: bool) -> tuple[bool, str]:
    """Whether an online trainer generates with its LoRA adapter merged (snaketrl.train.generation), and why.
    Measured faster on a CPU only (bench/merged_generation.py); a GPU keeps TRL's path until measured there. Off
    where merged sampling would differ from TRL's beyond fp32 rounding: LoRA dropout (TRL samples in training
    mode, the dropout on), bf16 or fp16 weights (a young adapter's small delta is lost in their rounding), a
    quantized base (merging requantizes it), DoRA; off under FSDP or ZeRO-3 (sharded weights) and vLLM (its own
    copy of the weights); off for a tiny model, whose numbers are measured on TRL's path."""
    lora, entry = run["lora"], run["model_entry"]
    if run["trainer"] not in GENERATES or device != "cpu" or "tiny" in entry:
        return False, ""
    if lora.get("lora_dropout", 0.0) or lora.get("use_dora") or entry.get("quantization") or sharded \
            or args.bf16 or args.fp16 or getattr(args, "use_vllm", False):
        return False, ""
    return True, ("a CPU's decode step skips the adapter's small matmuls (SmolLM2-135M, LoRA r16 on q/k/v/o, one "
                  "thread: 16 completions of 64 tokens in 4-6% less time, merging included)")


def samples_by_inverse_cdf(run: dict, device: str, args) -> tuple[bool, str]:
    """Whether an online trainer's generation draws each token by the inverse CDF (snaketrl.train.sampling) instead
    of torch.multinomial, and why: the same distribution, other tokens under a seed. On a CPU, where multinomial's
    exponential per vocabulary entry costs; a GPU keeps TRL's draw until measured there. Off under vLLM (its own
    sampler) and for a tiny model, whose numbers are measured on TRL's path."""
    if run["trainer"] not in GENERATES or device != "cpu" or "tiny" in run["model_entry"] \
            or getattr(args, "use_vllm", False):
        return False, ""
    return True, ("the same distribution as torch.multinomial at ~1 ms a decode step against 15-17 ms (16 rows of a "
                  "49,152-entry vocabulary, one thread; docs/benchmarks.md)")


def packs_for_generation(run: dict, device: str, args, sharded: bool, bf16_units: bool) -> tuple[bool, str]:
    """Whether an online trainer's generation multiplies by its bf16 linear layers' weights prepacked for oneDNN
    (snaketrl.train.packed), and why: the same logits, bit for bit. On a CPU whose oneDNN computes bf16
    (`bf16_units`: detect_device asks oneDNN) where the model trains in bf16 (its weights load in bf16 there); a
    GPU's matmuls do not go through oneDNN. Off under vLLM (its own weights), FSDP or ZeRO-3 (sharded weights), for
    a quantized base (its layers are not torch's linear) and for a tiny model, whose numbers are measured on TRL's
    path (it trains in fp32 on a CPU anyway)."""
    entry = run["model_entry"]
    if run["trainer"] not in GENERATES or device != "cpu" or not bf16_units or not args.bf16 or "tiny" in entry \
            or entry.get("quantization") or sharded or getattr(args, "use_vllm", False):
        return False, ""
    return True, ("oneDNN otherwise reorders each bf16 weight on every call: SmolLM2-135M's decode step on one EPYC "
                  "thread 27 ms against 47 ms for its layers, 6.9 against 11.5 ms for its head (docs/benchmarks.md)")


def dedupes_prefill(run: dict, device: str, args, sharded: bool) -> tuple[bool, str]:
    """Whether a GRPO or RLOO run's generation prefills each distinct prompt once (snaketrl.train.prefill), and why:
    the same logits and cache, bit for bit, on 1 / num_generations of the rows. On a CPU, where the prefill's
    matmuls are compute-bound; a GPU keeps transformers' prefill until measured there. Off under vLLM and TRL's
    continuous batching (their own prefill), FSDP or ZeRO-3 (gathered weights), with one generation a prompt (no
    repeated rows) and for a tiny model, whose numbers are measured on TRL's path."""
    if run["trainer"] not in ("grpo", "rloo") or device != "cpu" or "tiny" in run["model_entry"] or sharded \
            or getattr(args, "num_generations", 1) < 2 or getattr(args, "use_vllm", False) \
            or getattr(args, "use_transformers_continuous_batching", False):
        return False, ""
    return True, (f"its {args.num_generations} completions of a prompt share one prefill: SmolLM2-135M's generation "
                  f"of 16 completions of 4 prompts on one EPYC thread took 0.6-1.1 CPU-s less (docs/benchmarks.md)")


def merges_token_rows(run: dict, model_dir) -> tuple[bool, str]:
    """Whether a GRPO, RLOO or online DPO run generates with the token rows its model trains (a chat template's added
    tokens: peft's trainable tokens) merged into their layers' weights (snaketrl.train.generation
    .merge_rows_for_generation), and why: the same logits, without the whole weight built at each decode step. On
    every device and model: nothing differs but the copies."""
    if run["trainer"] not in GENERATES or not trains_token_rows(model_dir, run["lora"]):
        return False, ""
    return True, ("unmerged, peft's trainable tokens build their layer's whole weight (vocabulary x hidden) at every "
                  "forward, for the embeddings and again for a tied head: at Gemma 3's 262,146 x 640 in bf16, 0.19 "
                  "CPU-s a copy, two per decode step")


def reward_reads_as_trained(run: dict, train_file, reward_dir) -> tuple[bool, str]:
    """Whether a GRPO, RLOO or online DPO run's reward model reads its plain prompts and completions as
    RewardTrainer trained it, with eos (snaketrl.train.reward_reading), and why: where it has a reward model
    (`reward_dir`) and its prompts are plain text (TRL's own test: the first prompt's type, after the chat
    conversion snaketrl.train.run gives the rows). Conversations are rendered by the reward tokenizer's chat
    template, as trained, already."""
    if not REGISTRY[run["trainer"]].reward_funcs or not reward_dir:
        return False, ""
    with open(train_file) as rows:
        line = rows.readline()
    if not line.strip():
        return False, ""
    first = json.loads(line)
    if not isinstance((as_chat([first])[0] if run.get("chat", False) else first).get("prompt"), str):
        return False, ""
    return True, ("TRL scores plain text without the eos RewardTrainer appended to every text it trained on: on "
                  "SmolLM2 that score anti-correlated with the score with eos (-0.32 over 16 GRPO completions)")


# bench/rl.py --configfile bench/rl-gpu.yaml on an H200 (docs/benchmarks.md, "Online RL on a GPU"): GRPO's first
# step, which compiles, took 55 s against 14 s eager, each later step (one generation) 1.52 s against 7.80 s
# (7.33 s TRL's defaults): ~7 generations pay the compile back; 8 leave a margin.
PAYBACK_GENERATIONS = 8


def planned_generations(args, lengths: dict, world: int = 1) -> int | None:
    """An online run's generation rounds (TRL's defaults: one an optimizer step): from max_steps where set, else
    its epochs over the length stage's prompts, num_generations completions each, generation_batch_size (all
    processes') a round; None where neither tells. PPO's: its updates, total_episodes (else its epochs over the
    prompts) over the rollout batch of all `world` processes, as TRL's loop counts them (num_total_batches)."""
    if hasattr(args, "response_length"):
        episodes = args.total_episodes or (args.num_train_epochs * lengths["n_examples"]
                                           if lengths.get("n_examples") else None)
        if not episodes:
            return None
        return math.ceil(int(episodes) / (args.per_device_train_batch_size * args.gradient_accumulation_steps * world))
    if args.max_steps > 0:
        return math.ceil(args.max_steps * args.gradient_accumulation_steps
                         / (args.steps_per_generation * args.num_iterations))
    if not lengths.get("n_examples"):
        return None
    return math.ceil(args.num_train_epochs * lengths["n_examples"] * args.num_generations / args.generation_batch_size)


def cache_positions(lengths: dict, args) -> int:
    """The static cache's positions: the length stage's longest prompt (TRL cuts none) and the completion cap
    (static_cache_len). A longer prompt (an eval row) gets a larger cache from transformers, which sizes it to the
    larger of this and the call's length, and a recompile."""
    longest = lengths.get("percentiles", {}).get("p100") or lengths["max_length"]
    return static_cache_len(longest, getattr(args, "max_completion_length", None) or args.response_length)


def compiles_decode(run: dict, device: str, args, sharded: bool, generations: int | None) -> tuple[bool, str]:
    """Whether a GRPO, RLOO or PPO run decodes on a static cache through transformers' compiled forward (CUDA graphs;
    snaketrl.train.generation.compile_decode), and why. On CUDA only: a CPU measured it slower (docs/benchmarks.md).
    Off under vLLM and TRL's continuous batching (their own decode), FSDP or ZeRO-3 (sharded weights, gathered per
    forward), for a quantized base (unmeasured), under LoRA dropout (TRL samples with it on: random numbers in a
    CUDA graph, unmeasured), for a tiny model (its numbers are measured on TRL's path), and
    where the run's generation rounds (`generations`: planned_generations) are too few to pay the compile back
    (PAYBACK_GENERATIONS: ~8 steps as measured) or unknown: then why, for the plan's notes."""
    entry = run["model_entry"]
    if run["trainer"] not in COMPILES or device != "cuda" or "tiny" in entry or entry.get("quantization") or sharded \
            or run["lora"].get("lora_dropout", 0.0) or getattr(args, "use_vllm", False) \
            or getattr(args, "use_transformers_continuous_batching", False):
        return False, ""
    measured = ("on an H200, PPO on a Qwen2.5-0.5B shape (LoRA r16, bf16, 64 completions of 128 tokens an update) "
                "took 1.9 s an update compiled against 8.2 s for TRL's defaults (generation 6.1x faster), its first "
                "update 48 s against 20 s (bench/rl.py, docs/benchmarks.md)" if run["trainer"] == "ppo" else
                "on an H200, GRPO on a Qwen2.5-0.5B shape (LoRA r16, bf16, 64 completions of 128 tokens) took 1.52 s "
                "a step compiled against 7.80 s eager (generation 5.5x faster), its first step 55 s against 14 s "
                "(bench/rl.py, docs/benchmarks.md)")
    if generations is None:
        return False, f"the run's generation rounds are not known here to pay a compile back: {measured}"
    if generations < PAYBACK_GENERATIONS:
        return False, (f"{generations} generation rounds are too few to pay a compile back (~{PAYBACK_GENERATIONS} "
                       f"steps do): {measured}")
    return True, f"{generations} generation rounds pay its compile back (~{PAYBACK_GENERATIONS} steps do): {measured}"
