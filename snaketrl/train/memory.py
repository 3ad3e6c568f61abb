"""Activation checkpointing chosen from memory: TRL turns it on for every run, which recomputes each layer's
forward in the backward pass (about a third more compute) whether or not the activations would fit. A run that
does not set `activation_checkpointing` gets it only where its activations would not fit in the device's free
memory; it is exact either way, so only speed and memory change.

The estimate follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
a layer keeps about 34·h bytes per token in 16-bit with a 4h MLP (attention 11·h, MLP 19·h, norms 4·h), the
attention scores not kept (sdpa and flash attention recompute them); the MLP part is scaled to the model's
intermediate size. The logits add, per token, the vocabulary in fp32 about three times (logits, their log-softmax
and its gradient). It is an upper bound for a LoRA run, whose frozen weights need no gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

# Of the free memory, what activations may take: the rest is the allocator's fragmentation, the optimizer's
# LoRA states, evaluation and generation batches.
SHARE = 0.6


def activation_bytes(config: dict, tokens: int, dtype_bytes: int) -> int:
    """Activations a decoder keeps for the backward pass without checkpointing, for `tokens` tokens per forward
    (rows x padded length): `config` is the model's config.json."""
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    intermediate = text.get("intermediate_size") or 4 * hidden
    layers = text["num_hidden_layers"]
    per_layer = (15 * hidden + 19 * intermediate / 4) * dtype_bytes / 2  # attention + norms, then the MLP
    logits = 3 * 4 * text["vocab_size"]
    return int(tokens * (layers * per_layer + logits))


def weight_bytes(model_dir) -> int:
    """The model's weights as stored (its safetensors files): an upper bound once loaded in 16-bit or 4-bit."""
    return sum(p.stat().st_size for p in Path(model_dir).rglob("*.safetensors"))


def free_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    import psutil

    return psutil.virtual_memory().available


def choose_checkpointing(model_dir, tokens: int, dtype_bytes: int, free: int) -> tuple[bool, str]:
    """(checkpointing on?, why): on where the activations of a forward of `tokens` tokens would take more than
    SHARE of the memory left once the weights are loaded (`free`: the device's free bytes before loading)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    need = activation_bytes(config, tokens, dtype_bytes)
    room = SHARE * (free - weight_bytes(model_dir))
    gib = 2 ** 30
    why = (f"activations of {tokens} tokens per forward take about {need / gib:.2f} GiB without checkpointing, "
           f"against {room / gib:.2f} GiB ({SHARE:.0%} of the free memory after the weights)")
    return need > room, why
