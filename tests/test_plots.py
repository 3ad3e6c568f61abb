import json

import pandas as pd

from snaketrl.report.plots import group_metrics, log_frame, plot_run

DPO_STATE = {"global_step": 4, "log_history": [
    {"loss": 0.69, "rewards/chosen": 0.0, "rewards/margins": 0.0, "logps/chosen": -50.0, "learning_rate": 1e-3,
     "grad_norm": 1.0, "epoch": 0.5, "step": 2},
    {"eval_loss": 0.6, "eval_rewards/margins": 0.2, "eval_runtime": 0.1, "epoch": 0.5, "step": 2},
    {"loss": 0.5, "rewards/chosen": 0.3, "rewards/margins": 0.4, "logps/chosen": -45.0, "learning_rate": 1e-3,
     "grad_norm": 0.8, "epoch": 1.0, "step": 4},
    {"train_runtime": 3.0, "train_loss": 0.6, "train_samples_per_second": 10.0, "total_flos": 0.0, "epoch": 1.0,
     "step": 4},
]}


def test_groups_are_discovered_not_hard_coded():
    groups = group_metrics(["loss", "eval_loss", "rewards/chosen", "eval_rewards/margins", "rewards/margins",
                            "logps/chosen", "learning_rate", "grad_norm", "kl", "objective/rlhf_reward",
                            "train_runtime", "total_flos"])
    assert groups == {"loss": ["loss", "eval_loss"], "rewards": ["rewards/chosen", "eval_rewards/margins",
                                                                 "rewards/margins"],
                      "logps": ["logps/chosen"], "learning_rate": ["learning_rate"], "grad_norm": ["grad_norm"],
                      "kl": ["kl"], "objective": ["objective/rlhf_reward"]}


def test_log_frame_merges_train_and_eval_rows_by_step():
    df = log_frame(DPO_STATE)
    assert df.index.tolist() == [2, 4]
    assert df.loc[2, "eval_loss"] == 0.6 and df.loc[2, "loss"] == 0.69
    assert df.loc[4, "train_runtime"] == 3.0


def test_plot_run_writes_png_and_csv(tmp_path):
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps(DPO_STATE))
    plot_run(state, tmp_path / "c.png", tmp_path / "c.csv", "dpo")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    csv = pd.read_csv(tmp_path / "c.csv")
    assert len(csv) == 4 and "rewards/margins" in csv.columns


def test_headline_groups_lead():
    groups = group_metrics(["loss", "reward", "reward_std", "kl", "rewards/unique_chars/mean"],
                           first=("reward", "reward_std"))
    assert list(groups) == ["reward", "reward_std", "loss", "rewards", "kl"]
