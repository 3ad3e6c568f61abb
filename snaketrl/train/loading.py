"""Models and tokenizers as training loads them: dtype from the hardware, optional bitsandbytes QLoRA,
LoRA targets checked, a reward model's tokenizer checked against the policy's.
"""

from __future__ import annotations

from snaketrl.errors import ConfigError
from snaketrl.models.tokenizer import same_tokenizer
from snaketrl.trainers import MODEL_CLASSES


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
    if kwargs.get("attn_implementation") == "varlen":
        from snaketrl.train.attention import register

        register()
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


def check_reward_tokenizer(policy_tok, reward_dir, run_name: str, trust_remote_code: bool = False) -> None:
    """TRL issue 3595: PPO feeds the policy's token ids to the reward model unchanged. `trust_remote_code`: the
    reward run's model entry's (snaketrl.remote_code)."""
    from transformers import AutoTokenizer

    reward_tok = AutoTokenizer.from_pretrained(reward_dir, trust_remote_code=trust_remote_code)
    if not same_tokenizer(policy_tok, reward_tok):
        raise ConfigError(
            f"run '{run_name}': the reward model {reward_dir} has another tokenizer than the policy "
            f"(vocab {len(reward_tok)} vs {len(policy_tok)}, pad/eos {reward_tok.pad_token_id}/"
            f"{reward_tok.eos_token_id} vs {policy_tok.pad_token_id}/{policy_tok.eos_token_id}); "
            f"PPO passes token ids between them, so train the reward model from a model with the policy's tokenizer")
    if policy_tok.pad_token_id == policy_tok.eos_token_id:
        raise ConfigError(f"run '{run_name}': pad token equals eos token; PPO masks with != pad_token_id")
