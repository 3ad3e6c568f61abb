"""Training one run with any registered TRL trainer, LoRA/QLoRA, resumable checkpoints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

from snaketrl.config import BATCHING_FIELDS
from snaketrl.errors import ConfigError, did_you_mean
from snaketrl.data import read_jsonl
from snaketrl.distributed import SHARDED
from snaketrl.trainers import MODEL_CLASSES, REGISTRY, load

log = logging.getLogger("snaketrl.train")

# Fields the workflow owns: set from the DAG (paths, the length histogram) or from the hardware.
OWNED = {"output_dir": "the workflow", "max_length": "the length histogram (tune length.keep_share)",
         **{key: "the length stage's batching choice (length.batching)" for key in BATCHING_FIELDS}}


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


def check_hardware(args: dict, run: str = "?", model: str | None = None, entry: dict | None = None) -> None:
    """Settings that need a CUDA GPU fail here, before any model loads, when none is visible."""
    import importlib.util

    import torch

    if torch.cuda.is_available():
        if args.get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError(f"config: run '{run}': use_liger_kernel needs the liger-kernel package "
                              f"(pip install liger-kernel)")
        return
    if args.get("use_liger_kernel"):
        raise ConfigError(f"config: run '{run}': use_liger_kernel needs a CUDA GPU (Liger's kernels are Triton "
                          f"GPU kernels); none is visible")
    if args.get("activation_offloading"):
        raise ConfigError(f"config: run '{run}': activation_offloading moves activations from GPU to CPU memory and "
                          f"needs a CUDA GPU; none is visible")
    attention = (entry or {}).get("attn_implementation")
    if attention and "flash" in attention:
        raise ConfigError(f"config: models.{model}.attn_implementation: {attention} needs a CUDA GPU; none is visible")


def build_args(trainer: str, args: dict, *, output_dir: str, max_length: int, seed: int, run: str = "?",
               batching: dict | None = None):
    """The trainer's TRL config: the run's `args`, the length stage's `max_length` and `batching` args, the
    hardware's bf16."""
    import torch

    cls = check_args(trainer, args, run)
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    kwargs = {
        "report_to": "none",
        "seed": seed,
        **args,
        **(batching or {}),
        # TRL defaults bf16=True, which fails on a machine without a bf16 GPU: the hardware decides,
        # a config may only turn it off.
        "bf16": bf16 and args.get("bf16", True),
        "output_dir": output_dir,
    }
    if REGISTRY[trainer].length_field:
        kwargs[REGISTRY[trainer].length_field] = max_length
    if not kwargs["bf16"]:
        kwargs.setdefault("fp16", False)
    return cls(**kwargs)


def check_lora_targets(model, targets, model_name: str) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    missing = [t for t in ([targets] if isinstance(targets, str) else targets) if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "weight")
                         and getattr(m.weight, "ndim", 0) == 2 and n})
        raise ConfigError(f"config: models.{model_name}.lora.target_modules: {missing} not in the model "
                          f"({type(model).__name__}); its weight modules are {linear}")


def weight_dtype(bf16: bool) -> str:
    """The dtype a model's weights load in: bf16 on a bf16 GPU (TRL's config trains in it), else fp32."""
    return "bfloat16" if bf16 else "float32"


def quantization_config(quant: str, bf16: bool):
    """bitsandbytes settings of a QLoRA load (via TRL's own builder). 4-bit weights are stored in the dtype
    the rest of the model loads in: FSDP and ZeRO-3 shard only floating-point tensors of one dtype (peft's
    "QLoRA and FSDP" / "QLoRA and DeepSpeed ZeRO3" guides: bnb_4bit_quant_storage = the model's dtype; fp32
    under fp16 compute). Storage only packs the 4-bit codes, so a single GPU is indifferent to it."""
    from trl import ModelConfig, get_quantization_config

    return get_quantization_config(ModelConfig(
        load_in_4bit=quant == "4bit", load_in_8bit=quant == "8bit", dtype="bfloat16" if bf16 else "float16",
        bnb_4bit_quant_type="nf4", use_bnb_nested_quant=True, bnb_4bit_quant_storage=weight_dtype(bf16)))


def load_model(model_dir, model_name: str, entry: dict, bf16: bool, task_type: str = "CAUSAL_LM",
               sharded: bool = False, **kwargs):
    """`sharded`: FSDP or ZeRO-3 will shard the model across processes."""
    import torch
    import transformers

    if entry.get("attn_implementation"):
        kwargs.setdefault("attn_implementation", entry["attn_implementation"])
    quant = entry.get("quantization")
    if quant and not torch.cuda.is_available():
        raise ConfigError(f"config: models.{model_name}.quantization: {quant} loading (bitsandbytes QLoRA) "
                          f"needs a CUDA GPU; none is visible")
    if task_type == "SEQ_CLS":
        kwargs.setdefault("num_labels", 1)
    model = getattr(transformers, MODEL_CLASSES[task_type]).from_pretrained(
        model_dir, quantization_config=quantization_config(quant, bf16) if quant else None,
        dtype=getattr(torch, weight_dtype(bf16)), trust_remote_code=entry.get("trust_remote_code", False), **kwargs)
    # Its fp32 upcast of norms and embeddings would leave FSDP/ZeRO-3 tensors of two dtypes to shard
    # together; sharded QLoRA goes without it, as TRL's prepare_peft_model does.
    if quant and not sharded:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def last_checkpoint(checkpoint_dir: Path, parts: dict[str, str]) -> str | None:
    """The newest checkpoint made from the same config and the same inputs (`parts`: name -> content hash);
    checkpoints of anything else are removed, and the log says what changed."""
    from transformers.trainer_utils import get_last_checkpoint

    stamp = checkpoint_dir / "snaketrl_run.json"
    old = json.loads(stamp.read_text()).get("parts", {}) if stamp.is_file() else {}
    if any(checkpoint_dir.glob("checkpoint-*")) and old != parts:
        changed = sorted(k for k in {*old, *parts} if old.get(k) != parts.get(k))
        log.warning("checkpoints in %s were made with another %s: starting over", checkpoint_dir, ", ".join(changed))
        shutil.rmtree(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"parts": parts}, indent=2))
    return get_last_checkpoint(str(checkpoint_dir))


def prepare_tokenizer(tokenizer, model=None, padding_side: str | None = None):
    """A pad token distinct from eos (PPO and the reward model build masks from `!= pad_token_id`);
    models whose tokenizer has none (Pythia) get one, with embeddings grown if needed."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
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


def check_reward_tokenizer(policy_tok, reward_dir, run_name: str) -> None:
    """TRL issue 3595: PPO feeds the policy's token ids to the reward model unchanged."""
    from transformers import AutoTokenizer

    reward_tok = AutoTokenizer.from_pretrained(reward_dir)
    if not same_tokenizer(policy_tok, reward_tok):
        raise ConfigError(
            f"run '{run_name}': the reward model {reward_dir} has another tokenizer than the policy "
            f"(vocab {len(reward_tok)} vs {len(policy_tok)}, pad/eos {reward_tok.pad_token_id}/"
            f"{reward_tok.eos_token_id} vs {policy_tok.pad_token_id}/{policy_tok.eos_token_id}); "
            f"PPO passes token ids between them, so train the reward model from a model with the policy's tokenizer")
    if policy_tok.pad_token_id == policy_tok.eos_token_id:
        raise ConfigError(f"run '{run_name}': pad token equals eos token; PPO masks with != pad_token_id")


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


def split_model_rows(trainer) -> None:
    """Run the trainer's (and a separate reference model's) forward passes in row groups (snaketrl.batching)."""
    from snaketrl.batching import split_rows

    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            split_rows(model, trainer.args.pad_to_multiple_of)


def with_lengths(dataset, tokenizer, layout: str, column: str):
    """`dataset` with each example's tokens (a pair's longer side) in `column`: TRL tokenizes preference
    pairs into columns the length-grouped sampler cannot measure, so it reads this one."""
    from snaketrl.lengths import sequence_lengths

    return dataset.add_column(column, sequence_lengths(dataset.to_list(), tokenizer, layout).tolist())


def train_run(run: dict, *, model_dir, train_file, eval_file, lengths_file, out_dir, checkpoint_dir,
              reward_dir=None, threads: int | None = None, callbacks=None) -> dict:
    """Train one resolved run (snaketrl.config.resolve_run); write adapter/, trainer_state.json, metrics.json
    and manifest.json into out_dir, each whole or not at all."""
    from snaketrl import manifest, training_samples
    from snaketrl.io import atomic, hash_path, write_json
    from snaketrl.tokens import TokenCounter

    spec = REGISTRY[run["trainer"]]
    lengths = json.loads(Path(lengths_file).read_text())
    checkpoint_dir = Path(checkpoint_dir)
    # Histograms written before the length stage chose a batching train as TRL does by default.
    choice = lengths.get("batching", {})
    batching, split = choice.get("args", {}), choice.get("split_rows", False)
    check_args(run["trainer"], run["args"], run["name"])  # a misspelt field is named before a missing GPU
    check_hardware(run["args"], run["name"], run["model"], run["model_entry"])
    args = build_args(run["trainer"], run["args"], output_dir=str(checkpoint_dir), max_length=lengths["max_length"],
                      seed=run["seed"], run=run["name"], batching=batching)

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, set_seed

    if threads:
        torch.set_num_threads(threads)
    set_seed(run["seed"])
    entry = run["model_entry"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=entry.get("trust_remote_code", False))
    sharded = run["distributed"] in SHARDED and args.world_size > 1  # launched: one process per GPU
    model = load_model(model_dir, run["model"], entry, args.bf16, spec.task_type, sharded=sharded)
    prepare_tokenizer(tokenizer, model, padding_side="left" if spec.tokenized else None)
    check_lora_targets(model, run["lora"]["target_modules"], run["model"])
    peft_config = LoraConfig(task_type=spec.task_type, **run["lora"])
    extra = trainer_kwargs(spec, run, tokenizer, reward_dir, args.bf16)

    train_ds = Dataset.from_list(read_jsonl(train_file))
    eval_ds = Dataset.from_list(read_jsonl(eval_file))
    if batching.get("length_column_name"):
        train_ds, eval_ds = (with_lengths(ds, tokenizer, spec.layout, args.length_column_name)
                             for ds in (train_ds, eval_ds))
    counter = TokenCounter(tokenizer.pad_token_id)
    trainer_cls = load(spec.trainer)
    if batching.get("train_sampling_strategy") == "group_by_length":
        from snaketrl.sampler import with_grouped_sampler

        trainer_cls = with_grouped_sampler(trainer_cls)
    trainer = trainer_cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                          processing_class=tokenizer, peft_config=peft_config,
                          callbacks=[counter, *(callbacks or [])], **extra)
    if split and sharded:  # FSDP and ZeRO-3 gather each layer's weights per forward: keep TRL's one pass
        log.warning("%s: row groups are off under %s; TRL pads each batch's rows together", run["name"],
                    run["distributed"])
    elif split:
        split_model_rows(trainer)
    # Packed datasets hold sequences of several examples: nothing to count there (and TRL drops none).
    dropped = len(train_ds) - len(trainer.train_dataset) if spec.drops and not batching.get("packing") else None

    inputs = {"model": model_dir, "train": train_file, "eval": eval_file, "lengths": lengths_file,
              "reward_model": reward_dir}
    hashes = {name: hash_path(path) for name, path in inputs.items() if path}
    samples = checkpoint_dir / "training_samples.jsonl"  # survives a crash; a resume keeps earlier steps' rows
    # Resume only what the same config and the same inputs started.
    parts = {"config": _fingerprint(run), **hashes}
    resume = last_checkpoint(checkpoint_dir, parts)
    if resume:
        log.info("resuming %s from %s", run["name"], resume)
    training_samples.attach(trainer, samples, run["name"])
    metrics = dict(trainer.train(resume_from_checkpoint=resume).metrics)
    metrics.update(counter.summary())
    if dropped is not None:
        metrics["examples_dropped"] = dropped
    if spec.evaluates:
        metrics.update(trainer.evaluate())

    out_dir = Path(out_dir)
    with atomic(out_dir / "adapter", directory=True) as adapter_tmp:
        trainer.save_model(str(adapter_tmp))  # collective under accelerate: every rank calls it
        if trainer.is_world_process_zero():
            tokenizer.save_pretrained(str(adapter_tmp))
    if not trainer.is_world_process_zero():
        return metrics
    with atomic(out_dir / "trainer_state.json") as tmp:
        trainer.state.save_to_json(str(tmp))
    write_json(metrics, out_dir / "metrics.json")
    training_samples.finish(samples, out_dir / "training_samples.jsonl")
    manifest.write(out_dir / "manifest.json", resolved=run, trl_args=args.to_dict(),
                   inputs={name: {"path": str(inputs[name]), "sha256": h} for name, h in hashes.items()},
                   device="cuda" if torch.cuda.is_available() else "cpu", resumed_from=resume)
    return metrics


def merge(adapter_dir, base_dir, out_dir, task_type: str = "CAUSAL_LM", threads: int | None = None) -> None:
    """Base model + LoRA adapter -> one model directory (safetensors) that loads without peft."""
    import torch
    import transformers
    from peft import PeftModel

    from snaketrl.io import atomic

    if threads:
        torch.set_num_threads(threads)

    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir)
    kwargs = {"num_labels": 1} if task_type == "SEQ_CLS" else {}
    base = getattr(transformers, MODEL_CLASSES[task_type]).from_pretrained(base_dir, **kwargs)
    prepare_tokenizer(tokenizer, base)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    with atomic(out_dir, directory=True) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def launch_env(environ=None) -> dict:
    """launch_command's environment. Its processes start without Snakemake's script preamble, which is
    what put this package on a conda job's sys.path (Snakemake unsets PYTHONPATH there): name its home."""
    import os
    import sys

    environ = dict(os.environ if environ is None else environ)
    home = str(Path(__file__).resolve().parents[1])
    if home not in sys.path:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [home, environ.get("PYTHONPATH")]))
    return environ


def main(argv=None) -> None:
    import sys

    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    train_run(**job)


if __name__ == "__main__":
    main()
