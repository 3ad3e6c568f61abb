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
    length_field: str | None = "max_length"  # the TRL field the length histogram sets (None: prompts are cut instead)
    headline: tuple[str, ...] = ()  # log keys its users read first (summary table)
    overlay: str = "loss"  # the curve compared across models in the report
    model_class: str = "AutoModelForCausalLM"
    task_type: str = "CAUSAL_LM"  # peft task type; SEQ_CLS keeps the `score` head trainable and saved
    rewards: str | None = None  # "funcs": takes reward_funcs; "ppo": reward + value models
    generation_check: bool = False  # TRL's rule: the generation batch holds whole groups of num_generations
    tokenized: bool = False  # consumes input_ids prompts (left-padded), cut to the histogram's length
    evaluate: bool = True  # run trainer.evaluate() at the end (Online DPO's needs completions it lacks)


ONLINE = {"data": "prompt", "length_field": None, "rewards": "funcs", "generation_check": True,
          "overlay": "reward", "headline": ("reward", "reward_std", "completions/mean_length")}

REGISTRY: dict[str, TrainerSpec] = {
    "sft": TrainerSpec("trl:SFTConfig", "trl:SFTTrainer", "language_modeling",
                       headline=("mean_token_accuracy", "eval_mean_token_accuracy")),
    "dpo": TrainerSpec("trl:DPOConfig", "trl:DPOTrainer", "preference",
                       headline=("rewards/margins", "rewards/accuracies", "eval_rewards/accuracies")),
    "reward": TrainerSpec("trl:RewardConfig", "trl:RewardTrainer", "preference",
                          model_class="AutoModelForSequenceClassification", task_type="SEQ_CLS",
                          headline=("accuracy", "eval_accuracy", "margin")),
    "grpo": TrainerSpec("trl:GRPOConfig", "trl:GRPOTrainer", **ONLINE),
    "rloo": TrainerSpec("trl:RLOOConfig", "trl:RLOOTrainer", **ONLINE),
    "ppo": TrainerSpec("trl.experimental.ppo:PPOConfig", "trl.experimental.ppo:PPOTrainer", "prompt",
                       length_field=None, rewards="ppo", tokenized=True, overlay="objective/rlhf_reward",
                       headline=("objective/rlhf_reward", "objective/kl", "loss/policy_avg", "loss/value_avg")),
    "kto": TrainerSpec("trl:KTOConfig", "trl:KTOTrainer", "preference",
                       headline=("rewards/margins", "kl", "eval_rewards/margins")),
    "orpo": TrainerSpec("trl.experimental.orpo:ORPOConfig", "trl.experimental.orpo:ORPOTrainer", "preference",
                        headline=("rewards/margins", "rewards/accuracies", "log_odds_ratio")),
    "online_dpo": TrainerSpec("trl.experimental.online_dpo:OnlineDPOConfig",
                              "trl.experimental.online_dpo:OnlineDPOTrainer", "prompt", rewards="funcs",
                              length_field=None, evaluate=False, overlay="objective/scores",
                              headline=("objective/scores", "objective/kl", "rewards/margins")),
}


def load(dotted: str):
    module, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module), attr)
