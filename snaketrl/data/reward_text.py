"""The text a reward model reads: what TRL's RewardTrainer trained it on.

A conversation is the reward tokenizer's chat template. Plain prompt + completion gets the tokenizer's eos appended,
and is tokenized with its special tokens: RewardTrainer appends eos to every non-conversational chosen and rejected
text. The judge (snaketrl.evaluate.scoring) and the online trainers' reward (snaketrl.train.reward_reading) read
the same text, so a run trains on the score it is judged by.
"""

from __future__ import annotations


def plain_reward_text(text: str, tokenizer) -> str:
    """Plain prompt + completion as the reward model was trained on it: with its eos."""
    return text + (tokenizer.eos_token or "")
