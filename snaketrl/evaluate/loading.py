"""A run's model for evaluation: base + LoRA adapter (the base one context away), or a plain model.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from snaketrl.errors import ConfigError
from snaketrl.models.tokenizer import prepare_tokenizer


@dataclass
class Loaded:
    """A model in eval mode and its tokenizer (left padding, pad distinct from eos). `reference()` is a
    context in which the model is its base: the adapter disabled (peft); None for a plain model. `merged`: the
    adapter's weights are added into the base's (unmerged for the base's passes)."""

    model: object
    tokenizer: object
    has_reference: bool = False
    device: str = "cpu"
    merged: bool = False

    @contextlib.contextmanager
    def reference(self):
        if not self.has_reference:
            raise ValueError("a plain (or merged) model has no base to disable its adapter to")
        if self.merged:
            self.model.unmerge_adapter()
        try:
            with self.model.disable_adapter():
                yield
        finally:
            if self.merged:
                self.model.merge_adapter()


def load_for_eval(model_dir, adapter_dir=None, *, threads: int | None = None,
                  trust_remote_code: bool = False) -> Loaded:
    """Base model + LoRA adapter (peft, adapter kept separate so `reference()` gives the base without a
    second copy), or a plain/merged model. The tokenizer is the adapter's (training may have added a pad
    token) or the model's. `trust_remote_code`: the model entry's (snaketrl.remote_code)."""
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    if adapter_dir is not None:
        task = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("task_type")
        if task not in (None, "CAUSAL_LM"):
            raise ConfigError(f"evaluate: {adapter_dir} is a {task} adapter (a reward model), not a language "
                              f"model; reward models judge (evaluation.reward_models), they are not evaluated")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir or model_dir,
                                                           trust_remote_code=trust_remote_code)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                              trust_remote_code=trust_remote_code)
    prepare_tokenizer(tokenizer, model, padding_side="left")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(device).eval()
    # On a CPU an unmerged LoRA layer's two extra products cost a fifth of a forward pass (SmolLM2-135M, LoRA r 16
    # on q/k/v/o): the run's passes take the merged weights. fp32 only: there unmerging gives the base's weights
    # back to within rounding; in bf16 each merge would move them by a bf16 ulp.
    merged = adapter_dir is not None and device == "cpu" and dtype == torch.float32
    if merged:
        model.merge_adapter()
    return Loaded(model, tokenizer, has_reference=adapter_dir is not None, device=device, merged=merged)


def max_positions(model, default: int = 2048) -> int:
    return getattr(model.config, "max_position_embeddings", None) or default
