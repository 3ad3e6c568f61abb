"""Generation's frozen bf16 linear layers on a CPU, their weights prepacked for oneDNN.

torch's bf16 linear on a CPU runs oneDNN's brgemm, which reorders the weight into its blocked (VNNI) layout on every
call: a decode step of 16 rows reads each weight, writes the reordered copy and reads it again. On SmolLM2-135M
(one EPYC thread, all 30 layers' q/k/v/o/MLP weights streamed as a decode step streams them) that ran at 4.5 GB/s,
47 ms a step, and the tied 49,152 x 576 head 11.5 ms; with each weight reordered once (`mkldnn._reorder_linear_weight`,
what inductor's CPU freezing does) and multiplied by `mkldnn._linear_pointwise`, 27 ms and 6.9 ms, the same bits
(the same kernel on the same layout: tests/test_packed.py). Packing all of them takes ~0.1 s, once per generation:
the packed copies live for the call only (the trained pass may change any weight that trains) and hold one more
copy of the weights meanwhile (0.27 GB on SmolLM2).

Only plain `torch.nn.Linear` layers with bf16 weights on the CPU are packed (a LoRA layer's base layer, the MLP, the
head; the adapter's fp32 matrices keep torch's path); a call with gradients on or an input of another dtype falls
back to the layer's own forward. Applied by snaketrl.train.run.build_trainer where the plan says
(snaketrl.train.plan.packs_for_generation).
"""

from __future__ import annotations

import contextlib

from snaketrl.train.generation import around_generation


def packable(module) -> bool:
    """Whether `module` is a plain linear layer with bf16 weights on the CPU and no forward of its own set on it."""
    import torch

    return (type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16
            and module.weight.device.type == "cpu" and "forward" not in module.__dict__)


@contextlib.contextmanager
def packed(model):
    """`model`'s packable linear layers multiply by a prepacked copy of their weights within (without gradients);
    outside, their own forward again."""
    import torch

    patched = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if packable(module):
                    module.forward = packed_forward(module, torch.ops.mkldnn._reorder_linear_weight(module.weight))
                    patched.append(module)
        yield model
    finally:
        for module in patched:
            del module.forward


def packed_forward(module, weight):
    """`module`'s forward by oneDNN on `weight` (its weight packed), its own where gradients are on or the input
    is not in the weight's dtype."""
    import torch

    own = type(module).forward.__get__(module)
    bias = module.bias

    def forward(input):
        if torch.is_grad_enabled() or input.dtype != weight.dtype:
            return own(input)
        return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")

    return forward


def pack_for_generation(trainer, trainer_name: str) -> None:
    """Patch a built GRPO, RLOO or online DPO trainer: its generation runs with `packed` weights."""
    around_generation(trainer, trainer_name, lambda: packed(trainer.accelerator.unwrap_model(trainer.model_wrapped)))
