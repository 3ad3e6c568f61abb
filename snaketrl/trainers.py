"""The trainer registry: one entry per TRL trainer, no per-trainer pipeline.

Entries are plain strings so that the Snakefile can read them without importing trl.
`data` names the dataset schema the trainer consumes (see snaketrl.data.SCHEMAS).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerSpec:
    config: str  # "module:Class" of the TRL config
    trainer: str  # "module:Class" of the TRL trainer
    data: str  # key of snaketrl.data.SCHEMAS
    length_field: str = "max_length"  # the config field the length histogram sets
    headline: tuple[str, ...] = ()  # log keys its users read first (summary table)
    overlay: str = "loss"  # the curve compared across models in the report


REGISTRY: dict[str, TrainerSpec] = {
    "sft": TrainerSpec("trl:SFTConfig", "trl:SFTTrainer", "language_modeling",
                       headline=("mean_token_accuracy", "eval_mean_token_accuracy")),
    "dpo": TrainerSpec("trl:DPOConfig", "trl:DPOTrainer", "preference",
                       headline=("rewards/margins", "rewards/accuracies", "eval_rewards/accuracies")),
}


def load(dotted: str):
    module, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module), attr)
