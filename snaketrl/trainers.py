"""The trainer registry: one entry per TRL trainer, no per-trainer pipeline.

Entries are plain strings so that the Snakefile can read them without importing trl.
`layout` names the dataset layout the trainer consumes (see snaketrl.data.preprocess.LAYOUTS).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# peft task type -> the transformers auto class that loads such a model.
MODEL_CLASSES = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification"}

# TRL fields the length stage's batching choice sets (snaketrl.data.lengths.STRATEGY_ARGS,
# PAIR_GROUPING): a run may not set them.
BATCHING_FIELDS = ("packing", "packing_strategy", "train_sampling_strategy", "remove_unused_columns",
                   "length_column_name")


@dataclass(frozen=True)
class Trainer:
    config: str  # "module:Class" of the TRL config
    trainer: str  # "module:Class" of the TRL trainer
    layout: str  # key of snaketrl.data.preprocess.LAYOUTS
    length_field: str | None = "max_length"  # the TRL field the length histogram sets (None: prompts are cut instead)
    headline: tuple[str, ...] = ()  # log keys its users read first (summary table)
    overlay: str = "loss"  # the curve compared across runs in the report
    task_type: str = "CAUSAL_LM"  # peft task type; SEQ_CLS keeps the `score` head trainable and saved
    reward_funcs: bool = False  # takes reward functions (and optionally a reward model) as `reward_funcs`
    value_model: bool = False  # needs a reward model and a value model initialised from it (PPO)
    generation_check: bool = False  # TRL's rule: the generation batch holds whole groups of num_generations
    tokenized: bool = False  # consumes input_ids prompts (left-padded), cut to the histogram's length
    evaluates: bool = True  # run trainer.evaluate() at the end (Online DPO's needs completions it lacks)
    completions_per_prompt: int = 1  # the rows its training forward runs per prompt (online DPO's pair: 2)
    batching: tuple[str, ...] = ("padded",)  # batching strategies it can use (snaketrl.data.lengths.STRATEGY_ARGS)
    batching_note: str = ""  # why it has no other strategy: the histogram JSON and the report say so
    # Examples TRL drops instead of truncating: "long" (longer than max_length), "long_prompt" (a prompt alone
    # fills max_length, leaving no completion token to learn from; unpacked only).
    drops: str = ""
    # Grouped batches also run each batch's rows in two length groups (snaketrl.train.batching): its forward
    # takes right-padded rows, each scored on its own (a causal LM's log-probs or loss, a classifier's last
    # token).
    split_rows: bool = False
    # Eval rows it evaluates on when the run sets no eval_rows (None: all): a trainer that generates to evaluate
    # costs a generation batch per few prompts, so its eval during and after training stays bounded.
    eval_rows: int | None = None

    @property
    def generates(self) -> bool:
        """Samples completions during training (GRPO, RLOO, online DPO, PPO): its policy decodes with a KV cache."""
        return self.reward_funcs or self.value_model

    @property
    def model_class(self) -> str:
        return MODEL_CLASSES[self.task_type]


ONLINE = {"layout": "prompt", "length_field": None, "reward_funcs": True, "generation_check": True, "eval_rows": 64,
          "overlay": "reward", "headline": ("reward", "reward_std", "completions/mean_length"),
          "batching_note": "TRL's RepeatSampler orders the prompts (each repeated num_generations times), so "
                           "train_sampling_strategy does not apply; prompts are padded per batch as TRL does"}
# Preference pairs: TRL's DPO ignores padding_free, so batches are grouped by length instead.
PAIRS = ("padded", "grouped")

REGISTRY: dict[str, Trainer] = {
    "sft": Trainer("trl:SFTConfig", "trl:SFTTrainer", "language_modeling",
                   headline=("mean_token_accuracy", "eval_mean_token_accuracy"),
                   batching=("padded", "grouped", "packed"), drops="long_prompt", split_rows=True),
    "dpo": Trainer("trl:DPOConfig", "trl:DPOTrainer", "preference",
                   headline=("rewards/margins", "rewards/accuracies", "eval_rewards/accuracies"), batching=PAIRS,
                   drops="long_prompt", split_rows=True),
    "reward": Trainer("trl:RewardConfig", "trl:RewardTrainer", "preference", task_type="SEQ_CLS",
                      headline=("accuracy", "eval_accuracy", "margin"), batching=PAIRS, drops="long",
                      split_rows=True),
    "grpo": Trainer("trl:GRPOConfig", "trl:GRPOTrainer", **ONLINE),
    "rloo": Trainer("trl:RLOOConfig", "trl:RLOOTrainer", **ONLINE),
    # TRL's PPOTrainer, made resumable (snaketrl.train.ppo)
    "ppo": Trainer("trl.experimental.ppo:PPOConfig", "snaketrl.train.ppo:PPOTrainer", "prompt",
                   length_field=None, value_model=True, tokenized=True, evaluates=False,
                   overlay="objective/rlhf_reward",
                   headline=("objective/rlhf_reward", "objective/kl", "loss/policy_avg", "loss/value_avg"),
                   batching_note="PPO's own loop draws prompts from its own shuffling DataLoader; they are padded "
                                 "per batch as TRL does"),
    "kto": Trainer("trl:KTOConfig", "trl:KTOTrainer", "preference",
                   headline=("rewards/margins", "kl", "eval_rewards/margins"), drops="long_prompt",
                   batching_note="KTO estimates its KL term from each example's batch neighbours and needs TRL's "
                                 "sequential order (train_sampling_strategy='sequential')"),
    # TRL's ORPOTrainer, its rows cut at max_length as DPO's are and its odds ratio's gradient finite
    # (snaketrl.train.orpo)
    "orpo": Trainer("trl.experimental.orpo:ORPOConfig", "snaketrl.train.orpo:ORPOTrainer", "preference",
                    headline=("rewards/margins", "rewards/accuracies", "log_odds_ratio"), batching=PAIRS,
                    drops="long_prompt"),
    "online_dpo": Trainer("trl.experimental.online_dpo:OnlineDPOConfig",
                          "trl.experimental.online_dpo:OnlineDPOTrainer", "prompt", reward_funcs=True,
                          length_field=None, evaluates=False, completions_per_prompt=2, overlay="objective/scores",
                          headline=("objective/scores", "objective/kl", "rewards/margins"),
                          batching_note="Online DPO pads each batch's prompts for generation, whose cost is the "
                                        "completions'; its prompts are not grouped here"),
}


def load(dotted: str):
    module, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module), attr)
