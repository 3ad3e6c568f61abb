"""What each evaluation dataset is for, and the names of the scores: shared by the parse-time check
(snaketrl.config.evaluation) and the eval job.
"""

from __future__ import annotations

import re

from snaketrl.errors import DataError

# What each evaluation dataset is for: the layout it is prepared with (snaketrl.data.preprocess.LAYOUTS) and the
# columns the metric needs. Preference rows without a prompt get one from the shared start of
# chosen/rejected when preprocessed, so (chosen, rejected) datasets serve too.
KINDS = {
    "prompts": {"layout": "prompt", "needs": ("prompt",), "for": "generation"},
    "references": {"layout": "language_modeling", "needs": ("prompt", "completion"), "for": "held-out NLL"},
    "pairs": {"layout": "preference", "needs": ("prompt", "chosen", "rejected"), "for": "preference accuracy"},
}


def score_name(kind: str, name: str) -> str:
    """A score's column name: `fn_<function>` or `rm_<reward model run>`, as an SQL identifier."""
    return f"{kind}_" + re.sub(r"\W", "_", name.rsplit(":", 1)[-1] if kind == "fn" else name)


def reward_func_name(entry) -> str:
    return entry if isinstance(entry, str) else entry["function"]


def reward_model_run(entry) -> str:
    """The run an `evaluation.reward_models` entry names: the entry itself, or its `run` ({run, prompts})."""
    return entry.get("run") if isinstance(entry, dict) else entry


def check_rows(rows: list[dict], kind: str, where: str) -> None:
    """The eval job's check of its rows, before any model loads (DataError)."""
    if not rows:
        raise DataError(f"{where}: no rows")
    missing = next((c for c in KINDS[kind]["needs"] if c not in rows[0]), None)
    if missing:
        raise DataError(f"{where}: no column '{missing}' ({KINDS[kind]['for']} needs "
                        f"{', '.join(KINDS[kind]['needs'])}); columns are {list(rows[0])}")


# Where check_evaluation keeps the reward models' own prompts (run -> prompts) in the evaluation settings.
JUDGE_PROMPTS = "reward_model_prompts"


def judge_prompt_sets(ev: dict) -> dict[str, dict]:
    """The reward models' own prompt sets, one per dataset (dataset -> its prompts, as check_evaluation keeps
    them), in evaluation.reward_models order; empty where every reward model judges the yardstick's prompts."""
    sets: dict[str, dict] = {}
    for prompts in (ev.get(JUDGE_PROMPTS) or {}).values():
        sets.setdefault(prompts["dataset"], prompts)
    return sets


def judge_chat(dataset: str) -> str:
    """How an eval target's `chat` names a reward model's own prompts that reach its model as chat turns."""
    return f"{JUDGE_PROMPTS}:{dataset}"
