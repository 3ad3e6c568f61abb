"""bench/rl.py's arms on the tiny model: each step's time split, counts and rewards, and the table over them."""

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import rl  # noqa: E402


@pytest.mark.parametrize("trainer, arms", [("grpo", ("trl", "snaketrl")), ("rloo", ("trl-tuned",))])
def test_every_arm_splits_its_steps(trainer, arms, tmp_path, config, tiny_model_dir):
    from efficiency import length_settings
    from test_trainers import prepare

    inputs = prepare(tmp_path, config, tiny_model_dir, trainer)  # 4 completions a step, 2 per prompt, <= 8 tokens
    run = inputs["run"]
    run["args"] = {k: v for k, v in run["args"].items() if k not in ("max_steps", "eval_strategy", "save_steps")}
    results = {}
    for arm in arms:
        job = {"run": run, "arm": arm, "seed": 1, "settings": length_settings(config, run, "auto"),
               "model_dir": str(tiny_model_dir), "threads": 1, "train": str(inputs["train_file"]),
               "eval": str(inputs["eval_file"]), "work": str(tmp_path / arm),
               "schedule": {"max_steps": 2, "save_strategy": "no", "eval_strategy": "no", "logging_steps": 1}}
        result = rl.measure(job)
        assert "failed" not in result, result
        results[arm] = [result]
        # TRL's default; off in the tuned arms, and snaketrl's choice for a tiny model
        assert result["activation_checkpointing"] is (arm == "trl")
        assert result["continuous_batching"] is (arm == "trl-tuned-cb")
        assert result["bf16"] is False and result["peak_rss_mb"] > 100
        assert len(result["steps"]) == 2
        for step in result["steps"]:
            assert step["completions"] == 4
            assert 4 <= step["generated_tokens"] <= 4 * 8 and 0 <= step["at_cap"] <= 4
            assert step["trained_tokens"] > step["generated_tokens"]  # the prompts' real tokens beside
            # unique_chars: each completion's distinct characters (an empty one has none)
            assert 0 < step["reward"] <= 4 * 8 * 16
            parts = [step[f"{part}_s"] for part in ("generation", "scoring", "trained")]
            assert all(p > 0 for p in parts)
            assert 0 < step["rewards_s"] < step["scoring_s"]
            assert (step["logps_s"] > 0) is (trainer == "rloo")  # RLOO's reference (beta 0.05); GRPO's beta is 0
            # the seams cover the step: what they leave (clipping, the scheduler, callbacks) is a small part
            assert sum(parts) == pytest.approx(step["step_s"] - step["other_s"])
            assert 0 <= step["other_s"] < 0.25 * step["step_s"], step

    rows, best = rl.table("t", results)
    assert set(best) == set(arms)
    if "trl" not in arms:
        assert len(rows) == 1
        return
    assert len(rows) == 2 * len(arms) - 1  # each arm, then each other arm's ratios to trl
    assert all(row.count("|") == rl.HEADER[0].count("|") for row in rows)
    for arm in arms[1:]:
        ratio = next(r for r in rows if f"**{arm} / trl**" in r)
        speedup = best["trl"]["step_s"] / best[arm]["step_s"]
        assert f"**{speedup:.2f}×**" in ratio
    summary = best["trl"]
    assert summary["rewards"] == [s["reward"] for s in results["trl"][0]["steps"]]
    second = results["trl"][0]["steps"][1]  # the summary is of the steps after the first
    assert summary["completions_per_s"] == pytest.approx(4 / second["step_s"])
    assert summary["generated_tokens_per_s"] == pytest.approx(second["generated_tokens"] / second["generation_s"])
