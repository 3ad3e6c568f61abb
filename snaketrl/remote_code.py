"""trust_remote_code: off unless a model's config entry turns it on (`models.<name>.trust_remote_code`), and
then passed to every load of that model's tokenizer, config or weights, in every stage that loads one: the
length histogram and PPO's prompt tokenization, training, the merge, evaluation (the model evaluated and the
reward models judging). Each job learns it from its params (PPO's prompt tokenization from the length
histogram's JSON, which records it as it records `chat`). Plain Python: the Snakefile imports it.
"""

from __future__ import annotations

KEY = "trust_remote_code"


def trusted(entry: dict | None) -> bool:
    """Whether a model entry (or a job's params holding the key) turns remote code on."""
    return bool((entry or {}).get(KEY, False))


def param(entry: dict | None) -> dict:
    """{"trust_remote_code": True} for a model whose entry turns it on, else {}: absent where off, so the jobs of
    configs without it keep their params (and their results)."""
    return {KEY: True} if trusted(entry) else {}


# An eval job's params: the reward models judging its completions whose models' entries turn remote code on.
TRUSTED_JUDGES = "trust_remote_code_reward_models"
