"""How an online trainer generates: with its LoRA adapter merged into the base weights, or its decode compiled.

Unmerged, every decode step runs each adapted projection's two small matmuls, its scaling and its add beside the
base matmul. Merged (W + B A s in one matrix), a step runs the base model's matmuls only. The trained pass must
then see the exact base weights again: peft's unmerge subtracts the delta back, which drifts in floating point
step after step. So each merge writes into a new tensor (peft's safe_merge) and the restore puts the original
tensor back in place: the base weights are never written.

Compiled decode (`compile_decode`): the decode steps on a static KV cache through transformers' compiled forward,
on CUDA as CUDA graphs. On an H200 GRPO's step took 1.52 s against 7.80 s eager (generation 5.5x faster; a 0.5B
model's shape, 64 completions of 128 tokens), its first step 55 s against 14 s for the compile; on a CPU it measured
slower than the eager decode (docs/benchmarks.md). It composes with merged generation: the compiled step takes the
weights as inputs of its graph, so each call's merged copies are read, without a recompile (tests/test_generation.py).
TRL's PPO loop builds its generation config in `train`: `compile_policy_decode` sets the policy's instead, which
transformers merges under it. On an H200 PPO's update took 1.9 s against 8.2 s (TRL's defaults), its reward curve
within seed noise of TRL's (docs/benchmarks.md).

Both are decided in the plan (snaketrl.train.plan: `merges_for_generation` on a CPU, `compiles_decode` on CUDA) and
applied by snaketrl.train.run.build_trainer.
"""

from __future__ import annotations

import contextlib
import functools

# The method each online trainer generates with when it decodes with the policy's own generate (no vLLM): the
# reference, reward and value passes that follow it stay outside.
GENERATES = {"grpo": "_generate_single_turn", "rloo": "_generate_single_turn", "online_dpo": "_generate"}
# The trainers whose decode compile_decode compiles: GRPO's and RLOO's generation config, PPO's policy's.
COMPILES = ("grpo", "rloo", "ppo")


@contextlib.contextmanager
def merged(model, rows_only: bool = False):
    """`model`'s active LoRA adapters and trained token rows (peft's trainable tokens) merged into their layers' base
    weights within (`rows_only`: the rows alone); outside, the original base tensors (bit for bit: the same tensors)
    and the adapters applied in forward again."""
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    kinds = TrainableTokensLayer if rows_only else (LoraLayer, TrainableTokensLayer)
    layers = [m for m in model.modules() if isinstance(m, kinds) and not m.merged]
    kept = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                bias = base.bias.data if getattr(base, "bias", None) is not None else None
                kept.append((layer, base, base.weight.data, bias))
                # LoRA's safe merge writes a new tensor; peft's token rows always do (its finiteness check of the
                # whole merged weight, 0.2 CPU-s at Gemma 3's, is for adapters that may have diverged, not copied rows)
                layer.merge(safe_merge=isinstance(layer, LoraLayer))
                if base.weight.data.data_ptr() == kept[-1][2].data_ptr():
                    raise RuntimeError(f"peft merged {type(layer).__name__} in place: its base weights cannot be "
                                       f"restored exactly")
        yield model
    finally:
        for layer, base, weight, bias in reversed(kept):  # a tied head's rows merged into the embeddings' merge
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            layer.merged_adapters.clear()  # the forward applies the adapter again


def merge_for_generation(trainer, trainer_name: str) -> None:
    """Patch a built GRPO, RLOO or online DPO trainer: its generation runs merged (`merged`)."""
    around_generation(trainer, trainer_name, lambda: merged(trainer.accelerator.unwrap_model(trainer.model_wrapped)))


def merge_rows_for_generation(trainer, trainer_name: str) -> None:
    """Patch a built GRPO, RLOO or online DPO trainer whose model trains token rows (a chat template's added tokens):
    its generation runs with the rows merged. Unmerged, peft's layer builds its whole weight (vocabulary x hidden)
    at every forward, for the embeddings and again for a tied head: at Gemma 3's 262,146 x 640 in bf16, 0.19 CPU-s
    a copy, two per decode step. The same logits: the merged weight is the one each forward built. Decided in the
    plan (snaketrl.train.plan.merges_token_rows)."""
    around_generation(trainer, trainer_name,
                      lambda: merged(trainer.accelerator.unwrap_model(trainer.model_wrapped), rows_only=True))


def around_generation(trainer, trainer_name: str, context) -> None:
    """Patch a built GRPO, RLOO or online DPO trainer: each call of its generation runs within `context()` (a
    context manager's factory, called anew each time)."""
    name = GENERATES[trainer_name]
    generate = getattr(trainer, name)

    @functools.wraps(generate)
    def generate_within(*args, **kwargs):
        with context():
            return generate(*args, **kwargs)

    setattr(trainer, name, generate_within)


def static_cache_len(longest_prompt: int, completion: int) -> int:
    """compile_decode's cache positions for prompts of at most `longest_prompt` tokens and completions of at most
    `completion`, in 64s: one size for every batch, one compile per batch size."""
    return -(-(longest_prompt + completion) // 64) * 64


def compile_decode(trainer, max_cache_len: int, device: str) -> None:
    """Patch a built GRPO, RLOO or PPO trainer (generating with the policy's own generate): its decode steps run on a
    static KV cache of `max_cache_len` positions through transformers' compiled forward (on CUDA, CUDA graphs:
    one launch a step instead of a few hundred kernels). TRL sets `disable_compile` on its generation config; a
    cache of one size for every batch (the longest prompt plus the completion cap) keeps it to one compile per
    batch size. transformers compiles on CUDA only unless told otherwise: on another `device` its
    `_compile_all_devices` flag is set. `fullgraph`: a graph break in the decode step fails at the first step
    instead of running in pieces (under CUDA graphs, a piece's output is overwritten by the next piece's run:
    the H200's "accessing tensor output of CUDAGraphs that has been overwritten"). The prefill stays eager, as
    transformers runs it; snaketrl.train.cost.FlopMeter counts each compiled step outside its graph."""
    if hasattr(trainer, "policy_model"):  # TRL's PPO loop: no generation config of its own until `train`
        compile_policy_decode(trainer.policy_model, max_cache_len, device)
        return
    trainer.generation_kwargs.update(cache_implementation="static", max_cache_len=max_cache_len)
    set_compiled(trainer.generation_config, max_cache_len, device)


def compile_policy_decode(model, max_cache_len: int, device: str) -> None:
    """compile_decode for a trainer that builds its generation config anew in each call (TRL's PPO loop: in
    `train`): `model`'s own generation config (a peft model's: its base model's) gets the compiled decode's
    fields. transformers fills what a passed config leaves unset (PPO's sets sampling and length only) from it."""
    set_compiled(model.generation_config, max_cache_len, device)


def set_compiled(config, max_cache_len: int, device: str) -> None:
    """Set a GenerationConfig's fields for compile_decode: static cache, compile on, fullgraph."""
    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = device != "cuda" or None
    config.cache_implementation, config.max_cache_len, config.disable_compile = "static", max_cache_len, False
    config.compile_config = compile_config
