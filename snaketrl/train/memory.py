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
(the reward model) projects onto no vocabulary; ORPO one and a half times every position; GRPO and RLOO their
completion positions; the others every position, an upper bound where only labels are projected (SFT's one pass).
DPO, KTO and ORPO (`chunked`, where the plan sees their logits will be chunked: snaketrl.train.scored.plans_chunks)
project at most a chunk of positions at a time (snaketrl.train.scored: 64 MiB of fp32 logits, 64 positions at most;
a batch within 64 MiB keeps TRL's path, all at once), and a chunk's backward pass holds four fp32 copies of its
logits (its logits, their softmax, its gradient and the logits'), so that they count 16·V bytes for at most a
chunk's positions: a 65,536-entry vocabulary's step of 768 positions measured 0.997 of that estimate, TRL's path for
all of them at once 1.33 of the 12·V count (tests/test_memory.py). GRPO and RLOO (snaketrl.train.logps) chunk the
same way, and where all their completion logits fit in logps.KEPT_LOGITS_BYTES (`kept`) the chunks before the last
keep their fp32 logits for the backward pass too: 4·V bytes a position more. A head whose rows a chat template added
train (`trained_rows`: peft's TrainableTokensWrapper) builds its whole weight, vocabulary x hidden, once a pass
(snaketrl.train.head.one_weight_forward), which every chunk reads; over several chunks the backward pass holds it,
its gradient summed over the chunks and a chunk's own gradient until added: three copies, less the last chunk's
kept logits (freed by then) where chunks keep them; one in TRL's path (one chunk). tests/test_memory.py measures
GRPO's step at 0.995 to 1.05 of this count, kept or recomputed, plain head or trained rows (every tensor alive at
once; a 256-wide head, whose weight is four chunk logits' worth as Gemma 3's bf16 one is five). bench/vocab_memory.py
on Gemma 3 270M with ChatML (below; 4 completions of 32 tokens: 2 chunks kept, each with its own weight copy of 0.31
GiB then, before the one weight a pass): 1.54 GiB estimated against 1.38 measured (1.11; from the start of training
1.80: 0.86); on the 64-wide model with Gemma's vocabulary (a plain head) GRPO
0.315 against 0.348 (0.90), RLOO 0.315 against 0.317 (1.00). The count before, every position at 12·V prompts included,
was 2.9 times the 64-wide model's step and 1.04 of Gemma's only by the weight copies it did not know of (1.90 of
Gemma's step before the chunks kept their logits: 0.76 GiB measured then).
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
1.74: 0.98); GRPO as above; PPO 1.25 against 1.08 (1.16 with its head's one weight copy, 0.87 without; whole
run 2.51 with the value model's optimizer states; TRL's logits: 1.40 measured, 3.04 whole run, peak resident 5.94
GiB against 5.42 bounded), where one layer count and every position's logits said 1.69 (1.57).

Trained token rows on TRL's own path (DPO, KTO and ORPO keep it on such a head: snaketrl.train.scored.plans_chunks;
online DPO): peft's wrapper builds the whole weight once a forward, one copy alive at the peak (tests/test_memory.py:
DPO's step and online DPO's trained pass each 1.03 copies above the plain head's). Online DPO (`completions`) runs
two completions of each prompt (its rows twice the batch: snaketrl.train.plan.forward_tokens), takes the model's
logits for every position and a log-softmax of the completion positions alone. In a 16-bit run accelerate hands the
logits back in fp32 as well (convert_outputs_to_fp32, under autocast), and the backward pass holds both copies
again: 6 bytes per vocabulary entry of every position and 6 of each completion position (measured 5.6 and 5.5 at 48
to 144 positions a row, the trained pass, the reference's and the backward pass); in fp32, 4 and 8 (measured
exactly: tests/test_memory.py). The count before said every position at 12 bytes and half the rows: Gemma 3's
online DPO in the workflow (trace of its ops: bf16 logits of 8 x 145 positions, their fp32 copy, the slice's fp32
gradient and its bf16 copy) added 3.33 GiB against 1.88 estimated.

A job that keeps the memory it frees (snaketrl.processes.keep_freed_memory: every trainer on a CPU but those that
sample completions) holds TRL's every-position logits twice (`heap_kept`): its batches take new lengths every step,
the kept heap cannot place the next step's logits and their temporaries in the blocks the last step freed, and
grows by as much (the processes module measured SFT's loss settling at 1.9 times the memory it held given back).
bench/vocab_memory.py on Gemma 3 270M with ChatML (ORPO, 2 hh-rlhf pairs a step of 688 tokens, TRL's path): 3.25
GiB added given back, 5.93 kept; DPO's logits on label tokens alone 1.62 and 2.00. In the workflow (its hh-rlhf
pairs at 2 a forward, 234 positions a row: config/examples/other-architectures.yaml) Gemma 3's DPO scatters the
labels' bf16 logits into every position (0.46 GiB), makes an fp32 copy and a clone of it (0.91 each), for the policy
and again for the reference, and its entropy's per-row temporaries (0.23 GiB each) grew the kept heap at almost
every one: 5.9 GiB added in its first step, checkpointing on or off. A chunked trainer's chunks are of one size and
reuse their blocks. SFT's count of every position's logits bounds its kept heap already (its one pass projects the
labels alone: SmolLM2's SFT on LIMA held 0.7 GB more kept, against 2.8 GiB counted; Gemma 3's 0.90 of the count).

What training keeps besides activations (`trained_state_bytes`): PPO's value model trains every weight (TRL's
PolicyAndValueWrapper; peft adapts the policy alone), so each of its parameters has a gradient and AdamW's two
moments, in the weights' dtype (torch's AdamW keeps its states in the parameter's): 3 x 2 bytes a parameter in bf16,
1.50 GiB for Gemma 3 270M's value model, 2.76 for Qwen2.5-Coder-0.5B's, which the step adds on top of its activations
(docs/benchmarks.md: Qwen's PPO added 3.14 GiB against 1.18 of activations). Checkpointing does not shrink it, but
what the plan compares with the room is both.

The room (`choose_checkpointing`): SHARE of what is left once the weights are loaded, of the smaller of the device's
free memory and the job's own memory limit (on a CPU: the train rule's mem_mb resource, which a scheduler such as
SLURM enforces, and the process's cgroup limit where one is set: `memory_limit_bytes`); a GPU's room is its own
free memory.
"""

from __future__ import annotations

import json
import math
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
# Bytes per vocabulary entry of each position of GRPO's and RLOO's other chunks where they keep their logits for the
# backward pass (snaketrl.train.logps.KEPT_LOGITS_BYTES): the fp32 logits the log-softmax's backward reads.
KEPT_CHUNK_LOGITS = 4


def activation_bytes(config: dict, tokens: int, dtype_bytes: int, projected: int | None = None,
                     upcast_head: bool = False, chunked: bool = False, value_model: bool = False,
                     kept: bool = False, trained_rows: bool = False, completions: int | None = None,
                     heap_kept: bool = False) -> int:
    """Activations a decoder keeps for the backward pass without checkpointing, for `tokens` tokens per forward
    (rows x padded length): `config` is the model's config.json. `projected`: the positions among them whose
    logits the trainer computes (None: all); `upcast_head`: the loss keeps an fp32 copy of a 16-bit output
    projection (SFT's); `chunked`: the trainer projects at most a chunk of positions at once (DPO, KTO, ORPO:
    snaketrl.train.scored; GRPO, RLOO: snaketrl.train.logps; PPO: snaketrl.train.ppo), so that its logits count
    those positions at most; `kept`: the other chunks keep their logits for the backward pass where all of them fit
    in logps.KEPT_LOGITS_BYTES (GRPO's and RLOO's); `trained_rows`: a chunked trainer's output projection trains
    rows (a chat template's added tokens: peft's wrapper's whole weight, built once a pass, and its gradient summed
    over the chunks; on TRL's path, one copy); `value_model`: the trained pass runs a value
    model of the same shape on the same tokens (PPO's), whose layers count again; `completions`: the trainer takes
    the model's logits of every position in its dtype and a log-softmax of these completion positions alone (online
    DPO's); `heap_kept`: the job keeps the memory it frees, and its unchunked logits count twice."""
    from snaketrl.train.logps import chunk_positions, exceeds_chunk, keeps_too_much

    text = config.get("text_config", config)
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    intermediate = text.get("intermediate_size") or 4 * hidden
    layers = text["num_hidden_layers"]
    per_hidden, per_intermediate = KEPT[4 if dtype_bytes >= 4 else 2]
    per_layer = per_hidden * hidden + per_intermediate * intermediate
    positions = tokens if projected is None else projected
    compute = 4 if dtype_bytes >= 4 else 2  # a 4- or 8-bit base computes in 16-bit
    head = 4 * vocab * hidden if upcast_head and dtype_bytes < 4 else 0
    if chunked:
        # a batch whose logits fit in one chunk (CHUNK_BYTES) keeps TRL's path, all its positions at once
        several = exceeds_chunk(positions, vocab)
        chunk = chunk_positions(vocab, 4) if several else positions
        logits = CHUNKED_LOGITS * vocab * chunk
        kept_logits = kept and not keeps_too_much(positions, vocab)
        if kept_logits:
            logits += KEPT_CHUNK_LOGITS * vocab * (positions - chunk)
        if trained_rows:
            # the weight built once a pass (snaketrl.train.head.one_weight_forward); over several chunks the backward
            # pass sums the chunks' gradients of it in another such tensor, a chunk's own gradient of it beside it
            # until added: three copies, less the last chunk's kept logits, freed by then
            weight = vocab * hidden * compute
            head += 3 * weight - (KEPT_CHUNK_LOGITS * vocab * chunk if kept_logits else 0) if several else weight
    elif completions is not None:
        # a 16-bit run's logits come back from accelerate in fp32 as well (convert_outputs_to_fp32)
        logits = vocab * (6 * positions + 6 * completions if compute < 4 else 4 * positions + 8 * completions)
    else:
        logits = LOGITS * vocab * positions * (2 if heap_kept else 1)
    if trained_rows and not chunked:
        head += vocab * hidden * compute  # the weight peft's wrapper builds once a forward (TRL's path)
    return int(tokens * layers * per_layer * (2 if value_model else 1) + logits + head)


def weight_bytes(model_dir) -> int:
    """The model's weights as stored (its safetensors files): an upper bound once loaded in 16-bit or 4-bit."""
    return sum(p.stat().st_size for p in Path(model_dir).rglob("*.safetensors"))


def parameter_count(model_dir) -> int:
    """The parameters of the model in `model_dir`, from its safetensors files' headers (no weights read)."""
    count = 0
    for path in Path(model_dir).rglob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        count += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return count


# A trained weight's gradient and AdamW's two moments, each in the weight's dtype (module docstring).
TRAINED_COPIES = 3


def trained_state_bytes(value_model_dir, dtype_bytes: int) -> int:
    """What training keeps besides activations, beyond LoRA's small adapters: PPO's value model (`value_model_dir`:
    the reward run's model it starts from, None for the other trainers) trains every weight, each with a gradient
    and AdamW's two moments in the weights' dtype (`dtype_bytes`: 2 in bf16)."""
    if value_model_dir is None:
        return 0
    return TRAINED_COPIES * parameter_count(value_model_dir) * (4 if dtype_bytes >= 4 else 2)


def keeps_freed_memory(device: str, generates: bool) -> bool:
    """Whether a job keeps the memory it frees (snaketrl.processes): on a CPU, unless its trainer samples completions
    (it gives it back: snaketrl.train.run) or SNAKETRL_KEEP_FREED_MEMORY=0 leaves glibc's default; =1 keeps it
    whatever the trainer."""
    setting = os.environ.get("SNAKETRL_KEEP_FREED_MEMORY")
    return device == "cpu" and (setting == "1" or (not generates and setting != "0"))


def free_bytes(device: str) -> int:
    """Free bytes of this process's device: on CUDA its own GPU (a launched process's LOCAL_RANK, asked before
    accelerate selects it: GPU 0 would be every rank's)."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0]
    import psutil

    return psutil.virtual_memory().available


# The plan's numbers that a resumed run's plan may report differently: the free memory it saw.
RESUMED_KEYS = ("checkpointing_room_bytes",)


# Where a process's cgroup states its memory limit: cgroup v2's file, then v1's; "max" (v2) or a page-rounded
# 2**63 (v1) mean none.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_limit_bytes(files=CGROUP_LIMITS) -> int | None:
    """This process's cgroup memory limit, where one is set and readable."""
    for file in files:
        try:
            text = Path(file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2 ** 62:
            return int(text)
        return None
    return None


def memory_limit_bytes(mem_mb: int | None, files=CGROUP_LIMITS) -> tuple[int | None, str]:
    """(the job's own memory limit in bytes, what sets it): the smaller of the train rule's mem_mb resource
    (megabytes, as Snakemake and SLURM count them) and the process's cgroup limit; (None, "") where neither is."""
    limits = []
    if mem_mb:
        limits.append((int(mem_mb) * 10 ** 6, f"the job's mem_mb resource, {int(mem_mb)}"))
    cgroup = cgroup_limit_bytes(files)
    if cgroup is not None:
        limits.append((cgroup, f"the process's cgroup limit, {cgroup / 2 ** 30:.2f} GiB"))
    return min(limits) if limits else (None, "")


def choose_checkpointing(model_dir, tokens: int, dtype_bytes: int, free: int, projected: int | None = None,
                         upcast_head: bool = False, chunked: bool = False, value_model: bool = False,
                         kept: bool = False, trained_rows: bool = False, completions: int | None = None,
                         heap_kept: bool = False, trained_state: int = 0, other_weights: int = 0,
                         limit: int | None = None, limit_source: str = "") -> tuple[bool, str, dict]:
    """(checkpointing on?, why, the numbers compared): on where the activations of a forward of `tokens` tokens
    (`projected`, `upcast_head`, `chunked`, `value_model`, `kept`, `trained_rows`, `completions` and `heap_kept` as
    activation_bytes takes them) and `trained_state` (trained_state_bytes) would take more than SHARE of the memory
    left once the weights are loaded (the model's, and `other_weights`: a reward or value model's), of the smaller of
    `free` (the device's free bytes before loading) and `limit` (the job's own: memory_limit_bytes, set by
    `limit_source`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    activations = activation_bytes(config, tokens, dtype_bytes, projected, upcast_head, chunked, value_model, kept,
                                   trained_rows, completions, heap_kept)
    need = activations + trained_state
    limited = limit is not None and limit < free
    room = int(SHARE * ((limit if limited else free) - weight_bytes(model_dir) - other_weights))
    gib = 2 ** 30
    what = f"activations of {tokens} tokens per forward take about {activations / gib:.2f} GiB without checkpointing"
    if trained_state:
        what += f", and the value model's gradients and optimizer states {trained_state / gib:.2f} GiB more"
    where = (f"{limit_source} ({limit / gib:.2f} GiB), below the device's free memory" if limited else
             "the free memory")
    why = f"{what}, against {room / gib:.2f} GiB ({SHARE:.0%} of {where} after the weights)"
    numbers = {"activation_estimate_bytes": activations, "trained_state_estimate_bytes": trained_state,
               "checkpointing_room_bytes": room, "estimate_tokens_per_forward": tokens,
               **({"memory_limit_bytes": limit} if limit is not None else {})}
    return need > room, why, numbers
