"""The TRL config a run trains with: the run's args checked against its trainer's config class, the
hardware's bf16, the length stage's max_length and batching.
"""

from __future__ import annotations

import dataclasses

from snaketrl.errors import ConfigError, TrainingError, did_you_mean
from snaketrl.train.live import trackio_args
from snaketrl.trainers import BATCHING_FIELDS, REGISTRY, load

# Fields the workflow owns: set from the DAG (paths, the length histogram) or from the hardware.
OWNED = {"output_dir": "the workflow", "max_length": "the length histogram (tune length.keep_share)",
         "seed": "the top-level seed (`seeds: [...]`, top level or per run, repeats runs over seeds)",
         **{key: "the length stage's batching choice (length.batching: auto, padded, grouped, packed)"
            for key in BATCHING_FIELDS},
         "run_name": "the workflow (each run's own name, which trackio shows it under)",
         **{key: "the live view (report_to: trackio keeps the curves in results/trackio on this machine: "
                 "docs/live-view.md)" for key in ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")}}


def check_args(trainer: str, args: dict, run: str = "?") -> type:
    """Reject fields the trainer's TRL config class does not have, before anything heavy loads."""
    cls = load(REGISTRY[trainer].config)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in args:
        if key not in fields:
            raise ConfigError(f"config: run '{run}': '{key}' is not a field of trl.{cls.__name__}"
                              f"{did_you_mean(key, fields)}")
        if key in OWNED:
            raise ConfigError(f"config: run '{run}': '{key}' is set by {OWNED[key]}, not in args")
    return cls


def check_switches(trainer: str, args: dict, where: str, model: str, entry: dict) -> None:
    """Memory switches that cannot work with this trainer or this model's loading, refused at parse time with
    what to use instead (pure Python: the config check calls it; the train job again, before any model loads)."""
    quant = entry.get("quantization")
    if entry.get("attn_implementation") == "varlen" and REGISTRY[trainer].generates:
        raise ConfigError(f"config: {where}: models.{model}.attn_implementation varlen attends within whole "
                          f"sequences and has no KV cache, which {trainer} needs to generate completions; leave "
                          f"attn_implementation unset (sdpa) or use flash_attention_2 for this model's {trainer} runs")
    if args.get("use_liger_kernel") and trainer == "ppo":
        raise ConfigError(f"config: {where}: use_liger_kernel does nothing for PPO: TRL's PPOTrainer runs its own "
                          f"loop, which never applies Liger's kernels (transformers' Trainer does, for the other "
                          f"trainers); set it for the other trainers only (trainers.<name>.args)")
    if args.get("activation_offloading") and quant:
        raise ConfigError(f"config: {where}: activation_offloading with models.{model}.quantization {quant}: TRL "
                          f"1.12's offloading copies activations on a side stream, and with bitsandbytes' dequantized "
                          f"weights allocated and freed every matmul a run trained to NaN; use "
                          f"activation_checkpointing_kwargs: {{offload: true}} (transformers' own offloading, on the "
                          f"compute stream) or drop the quantization")


def check_liger_model(args: dict, model_dir, run: str = "?", model: str | None = None) -> None:
    """Liger patches a model by its `model_type`; one it has no kernels for would train unpatched, or fail inside
    TRL's fused loss (which asks the forward for what only a patched one returns). Called where Liger is
    installed (a CUDA job), before the model loads."""
    if not args.get("use_liger_kernel"):
        return
    import json
    from pathlib import Path

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"config: run '{run}': use_liger_kernel: Liger has no kernels for models.{model} "
                          f"(model_type {model_type}); it supports {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}: "
                          f"set use_liger_kernel for the runs of those models only (runs.<name>.args)")


def check_hardware(args: dict, run: str = "?", model: str | None = None, entry: dict | None = None, *,
                   cuda: bool) -> None:
    """Settings that need a CUDA GPU fail here, before any model loads, when none is visible (`cuda`: whether
    one is)."""
    import importlib.util

    if cuda:
        if args.get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError(f"config: run '{run}': use_liger_kernel needs the liger-kernel package "
                              f"(pip install liger-kernel)")
        if args.get("use_vllm") and importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"config: run '{run}': use_vllm needs the vllm package in the train job's environment "
                              f"(pip install vllm)")
        return
    if args.get("use_liger_kernel"):
        raise ConfigError(f"config: run '{run}': use_liger_kernel needs a CUDA GPU (Liger's kernels are Triton "
                          f"GPU kernels); none is visible")
    if args.get("activation_offloading"):
        raise ConfigError(f"config: run '{run}': activation_offloading moves activations from GPU to CPU memory and "
                          f"needs a CUDA GPU; none is visible")
    if args.get("use_vllm"):
        raise ConfigError(f"config: run '{run}': use_vllm generates with vLLM on a CUDA GPU; none is visible (drop "
                          f"use_vllm for this machine: TRL then generates with transformers)")
    attention = (entry or {}).get("attn_implementation")
    if attention and "flash" in attention:
        raise ConfigError(f"config: models.{model}.attn_implementation: {attention} needs a CUDA GPU; none is visible")
    if attention == "flex_attention":
        raise ConfigError(f"config: models.{model}.attn_implementation: flex_attention needs a CUDA GPU to train "
                          f"(torch's FlexAttention has no backward pass on a CPU); none is visible")


def native_bf16(cpu: bool = True) -> bool:
    """This machine computes bf16 natively: a CUDA GPU that supports it, or (with `cpu`) a CPU with bf16 matrix
    units, AVX512-BF16 or AMX, where oneDNN runs autocast's bf16 matrix products at two to sixteen times fp32's
    rate. Elsewhere a CPU emulates bf16, slower than fp32 (AVX2 has no bf16 instructions)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    # A build without oneDNN (or without the op) has no bf16 kernels to use
    try:
        return cpu and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def trl_kwargs(trainer: str, args: dict, *, output_dir: str, max_length: int, seed: int, run: str = "?",
               batching: dict | None = None, bf16: bool = False, cuda: bool = False) -> dict:
    """The fields of the trainer's TRL config: the run's `args` (and, reporting to trackio, its live view's),
    the length stage's `max_length` and `batching` args, and `bf16` where the hardware computes it natively (on
    a `cuda` GPU or a CPU)."""
    kwargs = {
        "report_to": "none",
        "seed": seed,
        **args,
        **trackio_args(args, run),
        **(batching or {}),
        # TRL defaults bf16=True, which fails on a machine without a bf16 GPU: the hardware decides,
        # a config may only turn it off.
        "bf16": bf16 and args.get("bf16", True),
        "output_dir": output_dir,
    }
    if REGISTRY[trainer].length_field:
        kwargs[REGISTRY[trainer].length_field] = max_length
    if REGISTRY[trainer].task_type == "SEQ_CLS" and kwargs.get("use_liger_kernel"):
        # transformers' Trainer applies Liger to the model instance, and Liger's apply_liger_kernel_to_<type> then
        # replaces the instance's forward with its causal-LM one (it reads self.lm_head) whatever the class; a
        # sequence classifier has none. Its RMSNorm, RoPE and SwiGLU kernels need no head: keep those.
        kwargs["liger_kernel_config"] = {**(kwargs.get("liger_kernel_config") or {}),
                                         "fused_linear_cross_entropy": False}
    if not kwargs["bf16"]:
        kwargs.setdefault("fp16", False)
    elif not cuda:  # transformers takes bf16 without a GPU for a mistake unless told
        kwargs["use_cpu"] = True
    return kwargs


def build_args(trainer: str, args: dict, *, output_dir: str, max_length: int, seed: int, run: str = "?",
               batching: dict | None = None, cpu_bf16: bool = False):
    """The trainer's TRL config on this machine (trl_kwargs with this machine's bf16; on a CPU only with
    `cpu_bf16`: the model may train in it there). The train job builds its own in its plan
    (snaketrl.train.plan)."""
    import torch

    cls = check_args(trainer, args, run)
    return cls(**trl_kwargs(trainer, args, output_dir=output_dir, max_length=max_length, seed=seed, run=run,
                            batching=batching, bf16=native_bf16(cpu=cpu_bf16), cuda=torch.cuda.is_available()))


def steps_for_tokens(max_tokens: int, args, lengths: dict, processes: int, packed: bool, lengths_file) -> int:
    """A run's max_tokens as optimizer steps: the budget over the real tokens of one step's examples (`args`, the
    TRL config's values, as one of `processes` trains them). A packed row is max_length tokens of examples (TRL packs
    rows full); otherwise an example has the length stage's mean_tokens."""
    import math

    if "mean_tokens" not in lengths:
        raise TrainingError(f"{lengths_file}: no mean_tokens (written by an older snaketrl), which max_tokens "
                            f"needs; rerun the histogram: snakemake --forcerun length_histogram")
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
    return max(1, math.ceil(max_tokens / (rows * (lengths["max_length"] if packed else lengths["mean_tokens"]))))


def split_batch(trainer: str, args: dict, processes: int) -> tuple[dict, dict]:
    """A run's args for one of `processes` processes that train together, and what the global batch became.
    The config's batch is the global one (per-device batch x gradient accumulation, as one process trains
    it): the accumulation steps are divided among the processes where they divide evenly (each process then
    runs the micro-batches one process would have), else the per-device batch, else the global batch grows
    `processes`-fold and `note` says so. The evaluation batch is divided where it divides."""
    if processes == 1:
        return args, {"processes": 1}
    cls = load(REGISTRY[trainer].config)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    per_device, accumulation, per_device_eval = (args.get(key, defaults[key]) for key in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size"))
    configured = per_device * accumulation
    group_rows = None
    if accumulation % processes == 0:
        accumulation //= processes
    elif per_device % processes == 0:
        per_device //= processes
        group_rows = per_device * processes  # one process's batch, dealt out: length-grouped as one (sampler.py)
    if per_device_eval % processes == 0:
        per_device_eval //= processes
    split = {**args, "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
             "per_device_eval_batch_size": per_device_eval}
    batch = {"processes": processes, "global_batch": per_device * processes * accumulation, "group_rows": group_rows}
    if batch["global_batch"] == configured:
        batch["note"] = (f"global batch {configured} as configured: {per_device} per process x {processes} "
                         f"processes x {accumulation} accumulation steps")
    else:
        batch["note"] = (f"global batch {batch['global_batch']}, not the configured {configured}: neither "
                         f"gradient_accumulation_steps {accumulation} nor per_device_train_batch_size {per_device} "
                         f"divides among {processes} processes")
    return split, batch
