"""snaketrl.train.memory's activation estimate against the peak memory one training step measures on a GPU.

A model of Qwen2.5-0.5B's shape (bench/gpu.yaml's), random weights in bf16, LoRA r=16 on every linear layer,
sdpa; one forward and backward of `rows` x `length` tokens with checkpointing off, then on. Prints, per batch
shape, the estimate, the measured peak above the weights and LoRA's states (torch.cuda.max_memory_allocated),
and their ratio: the estimate decides checkpointing, so it should sit at or a little above the measurement.

    python bench/memory.py                   # on a GPU
    python bench/memory.py --shapes 2x64     # a CPU smoke run (no peak to measure: estimates only)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 8192,
         "tie_word_embeddings": True}


def measure(model, rows: int, length: int, checkpointing: bool) -> int | None:
    """Peak bytes a training step adds to what is allocated before it (None on CPU)."""
    import torch

    device = next(model.parameters()).device
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()
    ids = torch.randint(5, SHAPE["vocab_size"], (rows, length), device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["8x512", "8x1024", "8x2048", "16x2048", "32x2048"],
                    help="rows x length of each batch")
    opts = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketrl.train.memory import activation_bytes

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    config = AutoConfig.for_model(**SHAPE, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model = get_peft_model(model.to("cuda" if cuda else "cpu"), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"], task_type="CAUSAL_LM"))
    model.enable_input_require_grads()  # as TRL does for a LoRA model under checkpointing
    gib = 2 ** 30
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {device}, torch {torch.__version__}")
    print("| rows x length | estimate (GiB) | measured, checkpointing off | estimate / measured | "
          "measured, checkpointing on |")
    print("|---|---|---|---|---|")
    for shape in opts.shapes:
        rows, length = map(int, shape.split("x"))
        estimate = activation_bytes(SHAPE, rows * length, 2 if cuda else 4)
        try:
            off = measure(model, rows, length, checkpointing=False)
        except torch.OutOfMemoryError:
            off = "out of memory"
        torch.cuda.empty_cache() if cuda else None
        on = measure(model, rows, length, checkpointing=True)
        ratio = f"{estimate / off:.2f}" if isinstance(off, int) else ""
        fmt = lambda v: v if isinstance(v, str) else ("" if v is None else f"{v / gib:.2f}")  # noqa: E731
        print(f"| {shape} | {estimate / gib:.2f} | {fmt(off)} | {ratio} | {fmt(on)} |", flush=True)


if __name__ == "__main__":
    main()
