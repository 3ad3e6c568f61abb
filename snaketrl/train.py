"""Training one run with any registered TRL trainer, LoRA/QLoRA, resumable checkpoints."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from snaketrl.errors import ConfigError
from snaketrl.data import read_jsonl
from snaketrl.trainers import REGISTRY, load

log = logging.getLogger("snaketrl.train")

# Fields the workflow owns: set from the DAG (paths, the length histogram) or from the hardware.
OWNED = {"output_dir": "the workflow", "max_length": "the length histogram (tune length.keep_share)"}


def check_args(trainer: str, args: dict, run: str = "?") -> type:
    """Reject fields the trainer's TRL config class does not have, before anything heavy loads."""
    cls = load(REGISTRY[trainer].config)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in args:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"config: run '{run}': '{key}' is not a field of trl.{cls.__name__}{hint}")
        if key in OWNED:
            raise ConfigError(f"config: run '{run}': '{key}' is set by {OWNED[key]}, not in args")
    return cls


def build_args(trainer: str, args: dict, *, output_dir: str, max_length: int, seed: int, run: str = "?"):
    import torch

    cls = check_args(trainer, args, run)
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    kwargs = {
        "report_to": "none",
        "seed": seed,
        **args,
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


def load_model(model_dir, model_name: str, entry: dict, bf16: bool, cls_name: str = "AutoModelForCausalLM",
               **kwargs):
    import torch
    import transformers

    quant = entry.get("quantization")
    qconfig = None
    if quant:
        if not torch.cuda.is_available():
            raise ConfigError(f"config: models.{model_name}.quantization: {quant} loading (bitsandbytes QLoRA) "
                              f"needs a CUDA GPU; none is visible")
        qconfig = transformers.BitsAndBytesConfig(
            load_in_4bit=quant == "4bit", load_in_8bit=quant == "8bit", bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float16)
    model = getattr(transformers, cls_name).from_pretrained(
        model_dir, quantization_config=qconfig, dtype=torch.bfloat16 if bf16 else torch.float32,
        trust_remote_code=entry.get("trust_remote_code", False), **kwargs)
    if quant:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def last_checkpoint(checkpoint_dir: Path, fingerprint: str) -> str | None:
    """The newest checkpoint of the same resolved run; checkpoints of another config are removed."""
    from transformers.trainer_utils import get_last_checkpoint

    stamp = checkpoint_dir / "snaketrl_run.json"
    stale = not stamp.is_file() or json.loads(stamp.read_text())["fingerprint"] != fingerprint
    if stale and any(checkpoint_dir.glob("checkpoint-*")):
        log.warning("checkpoints in %s belong to another configuration: starting over", checkpoint_dir)
        shutil.rmtree(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"fingerprint": fingerprint}))
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


def trainer_kwargs(spec, run_name: str, run: dict, tokenizer, reward_dir, bf16: bool) -> dict:
    """What a trainer takes beyond model/args/data: reward functions, or PPO's reward and value models."""
    if spec.reward_funcs:
        from snaketrl.rewards import resolve

        funcs = resolve(run.get("reward_funcs", []))
        if reward_dir:
            check_reward_tokenizer(tokenizer, reward_dir, run_name)
            funcs.append(str(reward_dir))  # TRL loads it as a sequence classifier with its own tokenizer
        return {"reward_funcs": funcs}
    if spec.value_model:
        check_reward_tokenizer(tokenizer, reward_dir, run_name)
        entry = {"trust_remote_code": False}
        # The value model starts as a copy of the reward model; the reference is the adapter-free policy.
        return {"reward_model": load_model(reward_dir, "reward", entry, bf16, "AutoModelForSequenceClassification",
                                           num_labels=1),
                "value_model": load_model(reward_dir, "value", entry, bf16, "AutoModelForSequenceClassification",
                                          num_labels=1),
                "ref_model": None}
    return {}


def train_run(*, run_name: str, run: dict, config: dict, model_dir, train_file, eval_file, lengths_file,
              out_dir, checkpoint_dir, reward_dir=None, manifest_inputs=(), callbacks=None) -> dict:
    """Train one run; write adapter/, trainer_state.json, metrics.json, manifest.json into out_dir."""
    from snaketrl import manifest
    from snaketrl.config import lora_args, trl_args

    spec = REGISTRY[run["trainer"]]
    lengths = json.loads(Path(lengths_file).read_text())
    user_args = trl_args(config, run)
    checkpoint_dir = Path(checkpoint_dir)
    args = build_args(run["trainer"], user_args, output_dir=str(checkpoint_dir), max_length=lengths["max_length"],
                      seed=config["seed"], run=run_name)

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, set_seed

    set_seed(config["seed"])
    entry = config["models"][run["model"]]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=entry.get("trust_remote_code", False))
    model_kwargs = {"num_labels": 1} if spec.task_type == "SEQ_CLS" else {}
    model = load_model(model_dir, run["model"], entry, args.bf16, spec.model_class, **model_kwargs)
    prepare_tokenizer(tokenizer, model, padding_side="left" if spec.tokenized else None)
    lora = lora_args(config, run["model"])
    check_lora_targets(model, lora["target_modules"], run["model"])
    if spec.task_type == "SEQ_CLS":
        # Known TRL pitfall: without this the freshly initialised `score` head is neither trained nor saved.
        lora = {**lora, "modules_to_save": sorted({*lora.get("modules_to_save", []), "score"})}
    peft_config = LoraConfig(task_type=spec.task_type, **lora)
    extra = trainer_kwargs(spec, run_name, run, tokenizer, reward_dir, args.bf16)

    train_ds = Dataset.from_list(read_jsonl(train_file))
    eval_ds = Dataset.from_list(read_jsonl(eval_file))
    trainer_cls = load(spec.trainer)
    trainer = trainer_cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks, **extra)

    resolved = {"run": run_name, **run, "args": user_args, "lora": lora, "max_length": lengths["max_length"],
                "seed": config["seed"], "model_entry": entry, "dataset_entry": config["datasets"][run["dataset"]]}
    if spec.own_loop:
        # PPO runs its own loop: no resume_from_checkpoint, no evaluate(), no final summary entry.
        resume = None
        started = time.perf_counter()
        trainer.train()
        metrics = {"train_runtime": time.perf_counter() - started, "global_step": trainer.state.global_step}
        trainer.state.log_history.append({**metrics, "step": trainer.state.global_step})
    else:
        resume = last_checkpoint(checkpoint_dir, _fingerprint(resolved))
        if resume:
            log.info("resuming %s from %s", run_name, resume)
        metrics = dict(trainer.train(resume_from_checkpoint=resume).metrics)
        if spec.evaluates:
            metrics.update(trainer.evaluate())

    out_dir = Path(out_dir)
    trainer.save_model(str(out_dir / "adapter"))  # collective under accelerate: every rank calls it
    if not trainer.is_world_process_zero():
        return metrics
    tokenizer.save_pretrained(str(out_dir / "adapter"))
    trainer.state.save_to_json(str(out_dir / "trainer_state.json"))
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    inputs = [train_file, eval_file, lengths_file, *manifest_inputs]
    manifest.write(out_dir / "manifest.json", resolved=resolved, trl_args=args.to_dict(), files=inputs,
                   device="cuda" if torch.cuda.is_available() else "cpu", resumed_from=resume)
    return metrics


def merge(adapter_dir, out_dir, model_class: str = "AutoModelForCausalLM") -> None:
    """Base model + LoRA adapter -> one model directory (safetensors) that loads without peft."""
    import transformers
    from peft import PeftConfig, PeftModel

    base_dir = PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir)
    kwargs = {"num_labels": 1} if model_class == "AutoModelForSequenceClassification" else {}
    base = getattr(transformers, model_class).from_pretrained(base_dir, **kwargs)
    prepare_tokenizer(tokenizer, base)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def launch_command(gpus: int, spec_file) -> list[str]:
    """One process per GPU on this node (`accelerate launch`), each running train_run from a JSON spec."""
    return ["accelerate", "launch", "--multi_gpu", f"--num_processes={gpus}", "--num_machines=1",
            "--mixed_precision=no",  # TRL's config decides bf16 from the hardware
            "-m", "snaketrl.train", str(spec_file)]


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

    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    train_run(**spec)


if __name__ == "__main__":
    main()
