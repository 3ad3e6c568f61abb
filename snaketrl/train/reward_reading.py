"""An online trainer's reward model reads plain text as it was trained on it (snaketrl.data.reward_text).

TRL's GRPO, RLOO and online DPO score plain prompt + completion without the eos that RewardTrainer appended to
every text it trained on, and without special tokens. On SmolLM2 that score anti-correlated with the same model's
score of the text with eos (−0.32 over 16 GRPO completions), so the online recipes climbed a reward their judge
scored down. Conversations are rendered by the reward tokenizer's chat template in both, as trained.
"""

from __future__ import annotations

from snaketrl.data.reward_text import plain_reward_text


class ReadsAsTrained:
    """A reward model's tokenizer as TRL calls it on plain texts: each text gets its eos, and special tokens are
    added. Everything else is the tokenizer's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, **kwargs):
        kwargs["add_special_tokens"] = True
        return self.tokenizer(text=[plain_reward_text(t, self.tokenizer) for t in text], **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def read_as_trained(trainer) -> None:
    """Every reward-model reward function of `trainer` reads plain texts as trained: for a run whose prompts are
    plain, as its plan decides (snaketrl.train.plan.reward_reads_as_trained)."""
    import torch

    for i, func in enumerate(trainer.reward_funcs):
        if isinstance(func, torch.nn.Module):
            trainer.reward_processing_classes[i] = ReadsAsTrained(trainer.reward_processing_classes[i])
