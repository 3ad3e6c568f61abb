"""bench/rl.py's arms on the tiny model: each step's time split, counts and rewards, and the table over them."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import rl  # noqa: E402


@pytest.mark.parametrize("trainer, arms", [("grpo", ("trl", "snaketrl")), ("rloo", ("trl-tuned",)),
                                           ("online_dpo", ("trl", "snaketrl"))])
def test_every_arm_splits_its_steps(trainer, arms, tmp_path, config, tiny_model_dir):
    from efficiency import length_settings
    from test_trainers import prepare

    inputs = prepare(tmp_path, config, tiny_model_dir, trainer)  # 2 completions a prompt, <= 8 tokens
    run = inputs["run"]
    run["args"] = {k: v for k, v in run["args"].items() if k not in ("max_steps", "eval_strategy", "save_steps")}
    # GRPO's and RLOO's batch counts completions (4: 2 prompts); online DPO's prompts (8 completions)
    completions = run["args"]["per_device_train_batch_size"] * (2 if trainer == "online_dpo" else 1)
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
            assert step["completions"] == completions
            assert completions <= step["generated_tokens"] <= completions * 8
            assert 0 <= step["at_cap"] <= completions
            assert step["trained_tokens"] > step["generated_tokens"]  # the prompts' real tokens beside
            # unique_chars: each completion's distinct characters (an empty one has none)
            assert 0 < step["reward"] <= 4 * 8 * 16
            assert 0 < step["rewards_s"] < step["scoring_s"]
            # RLOO's reference (beta 0.05) and online DPO's (its loss); GRPO's beta is 0
            assert (step["logps_s"] > 0) is (trainer != "grpo")
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
    assert summary["completions_per_s"] == pytest.approx(completions / second["step_s"])
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


def test_ppo_arms_split_their_updates(tmp_path, config, tiny_model_dir):
    """PPO on the tiny model (config.yaml's ppo-qwen2-tiny and its reward run, made short): the bench trains and
    merges the reward model, tokenizes the prompts, and each arm's updates split into parts that cover them."""
    from efficiency import shipped

    from snaketrl.config import resolve_runs

    config["trainers"]["reward"]["args"] = {"max_steps": 2, "per_device_train_batch_size": 4, "eval_strategy": "no"}
    config["trainers"]["ppo"]["args"].update(per_device_train_batch_size=4, local_rollout_forward_batch_size=4,
                                             response_length=8, num_ppo_epochs=2, num_mini_batches=2)
    config["matrix"]["models"] = ["qwen2-tiny"]
    runs = resolve_runs(config, shipped)
    run = runs["ppo-qwen2-tiny"]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "qwen2-tiny").symlink_to(tiny_model_dir)  # the bench's base, built already
    reward_dir = rl.reward_model(config, runs, run, tmp_path, threads=1)
    assert (reward_dir / "model.safetensors").is_file()
    assert rl.reward_model(config, runs, run, tmp_path) == reward_dir  # once per work dir
    train, evals, lengths = rl.ppo_prompts(config, run, tiny_model_dir, tmp_path)
    assert "input_ids" in json.loads(train.read_text().splitlines()[0])
    schedule = rl.ppo_schedule(run, 3)
    assert schedule["total_episodes"] == 12  # 3 updates of 4 completions
    results = {}
    for arm in ("trl", "snaketrl"):
        job = {"run": run, "arm": arm, "seed": 1, "settings": {}, "model_dir": str(tiny_model_dir), "threads": 1,
               "train": str(train), "eval": str(evals), "lengths": str(lengths), "reward_dir": str(reward_dir),
               "work": str(tmp_path / arm), "schedule": schedule}
        result = rl.measure(job)
        assert "failed" not in result, result
        results[arm] = [result]
        # PPOConfig's activation_checkpointing is on by default, but TRL's PPO loop never applies it
        assert result["activation_checkpointing"] is False and result["bf16"] is False
        assert len(result["steps"]) == 3
        for number, step in enumerate(result["steps"]):
            assert step["completions"] == 4
            assert 4 <= step["generated_tokens"] <= 4 * 8 and 0 <= step["at_cap"] <= 4
            # 2 PPO epochs over the 4 rows' prompts and completions
            assert step["trained_tokens"] > 2 * step["generated_tokens"]
            assert step["optimizer_s"] > 0 and step["rewards_s"] > 0 and step["logps_s"] > 0
            assert step["reward"] is not None and "rlhf_reward" in step
            for clock in ("", "_cpu"):
                parts = [step[f"{part}{clock}_s"] for part in rl.PARTS]
                assert sum(parts) == pytest.approx(step["step_s" if not clock else "cpu_s"])
                # other: TRL's gc.collect (timed), and a small rest (prompts, metrics, scheduler, callbacks) after
                # the first update, which pays one-off costs (the table leaves it out)
                assert 0 <= step[f"gc{clock}_s"] <= parts[-1]
                assert number == 0 or parts[-1] - step[f"gc{clock}_s"] < 0.25 * sum(parts), (arm, clock, step)
                assert all(p > 0 for p in parts[:3])
            assert step["rewards_s"] + step["logps_s"] < step["scoring_s"]
            assert step["optimizer_s"] < step["trained_s"]
    rows, best = rl.table("ppo", results)
    assert len(rows) == 3 and "**snaketrl / trl**" in rows[2]
    assert best["trl"]["rewards"] == [s["reward"] for s in results["trl"][0]["steps"]]


def test_the_compiled_ppo_arm_sets_the_policys_generation_config_before_training():
    """The snaketrl-compiled arm of PPO (no longer in NOT_FOR["ppo"]): the PPO trainer's `train` first puts the static
    cache (the longest tokenized prompt, 70, plus response_length 8, in 64s: 128) and the compile into its policy's
    generation config, from which transformers fills PPO's (tests/test_generation.py: the same tokens)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    assert "snaketrl-compiled" not in rl.NOT_FOR["ppo"]
    seen = []

    class Trainer:
        def train(self, resume_from_checkpoint=None):
            seen.append(self.policy_model.generation_config.to_dict())
            return "trained"

    rl.compiled_ppo(Trainer)
    trainer = Trainer()
    trainer.train_dataset = {"input_ids": [[5] * 10, [5] * 70, [5] * 40]}
    trainer.args = SimpleNamespace(response_length=8)
    trainer.accelerator = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    trainer.policy_model = SimpleNamespace(generation_config=GenerationConfig())
    assert trainer.train() == "trained"
    [config] = seen
    assert (config["cache_implementation"], config["max_cache_len"], config["disable_compile"]) == ("static", 128,
                                                                                                   False)
    assert config["compile_config"].fullgraph is True
