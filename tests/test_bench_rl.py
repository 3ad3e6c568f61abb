"""bench/rl.py's arms on the tiny model: each step's time split, counts and rewards, and the table over them."""

import json
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
            assert 0 < step["rewards_s"] < step["scoring_s"]
            assert (step["logps_s"] > 0) is (trainer == "rloo")  # RLOO's reference (beta 0.05); GRPO's beta is 0
            # the seams cover the step, on both clocks: what they leave (clipping, the scheduler, callbacks) is a
            # small part
            for clock in ("", "_cpu"):
                parts = [step[f"{part}{clock}_s"] for part in ("generation", "scoring", "trained", "other")]
                assert sum(parts) == pytest.approx(step["step_s" if not clock else "cpu_s"])
                assert 0 <= parts[-1] < 0.25 * sum(parts), (clock, step)
                assert all(p > 0 for p in parts[:3])

    rows, best = rl.table("t", results)
    assert all(f"{best[arm]['generation_s']:.2f} / {best[arm]['generation_cpu_s']:.2f}" in row
               for arm, row in zip(arms, rows))
    assert set(best) == set(arms)
    if "trl" not in arms:
        assert len(rows) == 1
        return
    assert len(rows) == 2 * len(arms) - 1  # each arm, then each other arm's ratios to trl
    assert all(row.count("|") == rl.HEADER[0].count("|") for row in rows)
    for arm in arms[1:]:
        ratio = next(r for r in rows if f"**{arm} / trl**" in r)
        wall, cpu = (best["trl"][key] / best[arm][key] for key in ("step_s", "cpu_s"))
        assert f"| {wall:.2f}× | **{cpu:.2f}×** |" in ratio
    summary = best["trl"]
    assert summary["rewards"] == [s["reward"] for s in results["trl"][0]["steps"]]
    second = results["trl"][0]["steps"][1]  # the summary is of the steps after the first
    assert summary["completions_per_s"] == pytest.approx(4 / second["step_s"])
    assert summary["generated_tokens_per_s"] == pytest.approx(second["generated_tokens"] / second["generation_s"])


def test_the_table_prints_again_from_the_out_file(tmp_path, capsys):
    step = {"step_s": 2.0, "cpu_s": 1.0, "generation_s": 1.2, "scoring_s": 0.1, "trained_s": 0.6, "other_s": 0.1,
            "rewards_s": 0.01, "logps_s": 0.0, "optimizer_s": 0.01, "completions": 16, "generated_tokens": 640,
            "trained_tokens": 1000, "at_cap": 8, "reward": 0.25}  # a file from before the CPU split: wall only
    result = {"arm": "trl", "seed": 1, "activation_checkpointing": True, "bf16": False, "continuous_batching": False,
              "peak_rss_mb": 3000.0, "steps": [step, {**step, "reward": 0.5}]}
    faster = {**result, "arm": "snaketrl", "activation_checkpointing": False,
              "steps": [{**step, "step_s": 1.0, "generation_s": 0.6, "trained_s": 0.3}] * 2}
    out = tmp_path / "rl.json"
    out.write_text(json.dumps({"device": "a CPU", "runs": {"grpo": {"results": {"trl": [result],
                                                                                "snaketrl": [faster]}}}}))
    rl.main(["--table", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device: a CPU" and lines[1:3] == rl.HEADER
    assert lines[3].startswith("| grpo | trl (checkpointing on, fp32) | 2.0 | 1.0 | 1.20 | 0.10 | 0.60 | 0.10 "
                               "| 8.000 | 533.3 | 1667 | 3000 | 0.25 0.50 |")
    # twice as fast a step, the same CPU seconds; the reward curve 0.25 lower at both steps (one seed: no SE)
    assert lines[5] == "| grpo | **snaketrl / trl** | 2.00× | **1.00×** | 2.00× | 1.00× | 2.00× | | 2.00× | 2.00× " \
                       "| 2.00× | 1.00× | | |"
    assert lines[4].endswith("| 0.25 0.25 | -0.125 |")
