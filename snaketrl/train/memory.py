"""Activation checkpointing chosen from memory: TRL turns it on for every run, which recomputes each layer's
forward in the backward pass (about a third more compute) whether or not the activations would fit. A run that
does not set `activation_checkpointing` gets it only where its activations would not fit in the device's free
memory; it is exact either way, so only speed and memory change.

The estimate counts what autograd keeps for the backward pass of a LoRA run, per token and decoder layer:
38·h + 10·I bytes on a 16-bit base, 27·h + 16·I in fp32 (h the hidden size, I the MLP's intermediate size).
These are measured, not derived: the tensors saved for backward (torch.autograd.graph.saved_tensors_hooks) of
Qwen2 models of several shapes, with peft's adapters in fp32, its default also on a 16-bit base, so each
adapted layer's input is kept again in fp32; rounded up to cover every shape measured, and measured again on
another shape by tests/test_switches.py (0 to 5 % above). On an H200 the estimate came to 1.00 to 1.01 times
the measured peak of one training step of Qwen2.5-0.5B's shape in bf16 with sdpa, 8 x 512 to 32 x 2048 tokens
(bench/memory.py: 30.83 GiB measured at 8 x 2048, 31.03 estimated). The Korthikanti et al. 2022 count used
before (34·h per layer with a 4h MLP) came to 0.46 of the peak: it leaves out the norms' fp32 copies and the
adapters' inputs. The logits add, per token, the vocabulary in fp32 three times (the log-softmax kept for the
loss, then its gradient and the logits' at the start of the backward): 12·V bytes, as the same measurement
found. It is an upper bound for a full fine-tune, which keeps no adapter inputs.

The logits count where a trainer computes them (`projected`, snaketrl.train.plan.projected_tokens): a classifier
(the reward model) projects onto no vocabulary; ORPO one and a half times every position; the others every
position, an upper bound where only labels or completions are projected (SFT's one pass, GRPO). DPO, KTO and
ORPO (`chunked`, where the plan sees their logits will be chunked: snaketrl.train.scored.plans_chunks) project at
most a chunk of positions at a time (snaketrl.train.scored: 64 MiB of fp32 logits, 64 positions at most), and a
chunk's backward pass holds four fp32 copies of its logits (its logits, their softmax, its gradient and the
logits'), so that they count 16·V bytes for at most a chunk's positions: a 65,536-entry vocabulary's step of 768
positions measured 0.997 of that estimate, TRL's path for all of them at once 1.33 of the 12·V count
(tests/test_memory.py).
SFT's loss (TRL's chunked_nll, and snaketrl's one pass on a CPU) computes in fp32 with an fp32 copy of a 16-bit
output projection, vocabulary x hidden x 4 bytes, which the one pass keeps for the backward pass: at Gemma 3's
262,144 x 640 it is 0.625 GiB, more than the activations of a small batch (bench/vocab_memory.py: Gemma 3 270M, bf16,
2 rows, measured 1.17 GiB above the start of training, estimated 0.69 without the copy, 1.31 with it).
PPO (`value_model`): its trained pass runs the policy and the value model (the reward run's model, taken as the
policy's shape) on the same tokens, so the layers count twice, and its logits a chunk at a time
(snaketrl.train.ppo.bound_logits) where the model's logits are its projection alone (snaketrl.train.logps
.projection_alone). Gemma 3 270M in bf16 on a CPU (bench/vocab_memory.py: 4 rows, prompts cut to 128 tokens, 32
completion tokens; the estimate for the tokens each step trained, against the peak resident memory the last step
added): SFT 1.71 GiB estimated, 1.59 measured (1.08; the whole run, first step's one-time allocations included,
1.74: 0.98); GRPO 1.44 against 0.76 (1.90; whole run 1.03: 1.40), every position counted where it projects its
completions in chunks, for a chunk's count (0.54) would fall below the peak; PPO 0.94 against 1.08 (0.87; whole
run 2.51 with the value model's optimizer states; TRL's logits: 1.40 measured, 3.04 whole run, peak resident 5.94
GiB against 5.42 bounded), where one layer count and every position's logits said 1.69 (1.57).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Of the free memory, what activations may take: the rest is the allocator's fragmentation, the optimizer's
# LoRA states, evaluation and generation batches.
SHARE = 0.6


# Bytes kept per token and layer for each hidden and each intermediate unit, by the bytes of the base's weights
# (a 4- or 8-bit base computes in 16-bit); measured as the module docstring says.
KEPT = {2: (38, 10), 4: (27, 16)}
LOGITS = 3 * 4  # bytes per token and vocabulary entry
# Bytes per vocabulary entry of each position of a chunk (snaketrl.train.scored): the chunk's backward pass holds its
# logits, their softmax, its gradient and the logits' gradient at once, in fp32 (measured: tests/test_memory.py).
CHUNKED_LOGITS = 4 * 4


def activation_bytes(config: dict, tokens: int, dtype_bytes: int, projected: int | None = None,
                     upcast_head: bool = False, chunked: bool = False, value_model: bool = False) -> int:
    """Activations a decoder keeps for the backward pass without checkpointing, for `tokens` tokens per forward
    (rows x padded length): `config` is the model's config.json. `projected`: the positions among them whose
    logits the trainer computes (None: all); `upcast_head`: the loss keeps an fp32 copy of a 16-bit output
    projection (SFT's); `chunked`: the trainer projects at most a chunk of positions at once (DPO, KTO, ORPO:
    snaketrl.train.scored), so that its logits count those positions at most; `value_model`: the trained pass runs
    a value model of the same shape on the same tokens (PPO's), whose layers count again."""
    from snaketrl.train.logps import chunk_positions

    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    intermediate = text.get("intermediate_size") or 4 * hidden
    layers = text["num_hidden_layers"]
    per_hidden, per_intermediate = KEPT[4 if dtype_bytes >= 4 else 2]
    per_layer = per_hidden * hidden + per_intermediate * intermediate
    positions = tokens if projected is None else projected
    if chunked:
        logits = CHUNKED_LOGITS * text["vocab_size"] * min(positions, chunk_positions(text["vocab_size"], 4))
    else:
        logits = LOGITS * text["vocab_size"] * positions
    head = 4 * text["vocab_size"] * hidden if upcast_head and dtype_bytes < 4 else 0
    return int(tokens * layers * per_layer * (2 if value_model else 1) + logits + head)


def weight_bytes(model_dir) -> int:
    """The model's weights as stored (its safetensors files): an upper bound once loaded in 16-bit or 4-bit."""
    return sum(p.stat().st_size for p in Path(model_dir).rglob("*.safetensors"))


def free_bytes(device: str) -> int:
    """Free bytes of this process's device: on CUDA its own GPU (a launched process's LOCAL_RANK, asked before
    accelerate selects it: GPU 0 would be every rank's)."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0]
    import psutil

    return psutil.virtual_memory().available


def choose_checkpointing(model_dir, tokens: int, dtype_bytes: int, free: int, projected: int | None = None,
                         upcast_head: bool = False, chunked: bool = False,
                         value_model: bool = False) -> tuple[bool, str]:
    """(checkpointing on?, why): on where the activations of a forward of `tokens` tokens (`projected`,
    `upcast_head`, `chunked` and `value_model` as activation_bytes takes them) would take more than SHARE of the
    memory left once the weights are loaded (`free`: the device's free bytes before loading)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    need = activation_bytes(config, tokens, dtype_bytes, projected, upcast_head, chunked, value_model)
    room = SHARE * (free - weight_bytes(model_dir))
    gib = 2 ** 30
    why = (f"activations of {tokens} tokens per forward take about {need / gib:.2f} GiB without checkpointing, "
           f"against {room / gib:.2f} GiB ({SHARE:.0%} of the free memory after the weights)")
    return need > room, why
