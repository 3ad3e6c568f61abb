"""PPO survives preemption: killed at an update and rerun, it ends exactly where an uninterrupted run does,
and an uninterrupted run is TRL's own PPO."""

import dataclasses
import gc
import json

import pytest
from test_train import _interrupt_at_step_4
from test_trainers import prepare

from snaketrl.io import read_jsonl, write_jsonl
from snaketrl.trainers import REGISTRY

# 8 prompts in batches of 4: 2 batches a pass, 6 updates, so the checkpoint at update 3 sits inside the
# second pass and the resumed run starts a third. Samples every 2nd update (1, 3, 5): the checkpoint's
# update is one, and the resumed run's loop count (1, 2, 3 for updates 4, 5, 6) is off by 3.
ARGS = {"total_episodes": 24, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
        "local_rollout_forward_batch_size": 4, "response_length": 8, "num_ppo_epochs": 1, "stop_token": "eos",
        "num_sample_generations": 3, "save_steps": 3, "save_total_limit": 2, "logging_steps": 1}
CLOCK = {"eps", "train_runtime"}  # wall-clock throughput and duration: the only values allowed to differ


@pytest.fixture
def ppo_inputs(tmp_path, config, tiny_model_dir, reward_dir):
    import torch

    inputs = prepare(tmp_path, config, tiny_model_dir, "ppo")
    inputs["run"]["args"].update(ARGS)
    write_jsonl(read_jsonl(inputs["train_file"])[:8], inputs["train_file"])
    del inputs["out_dir"], inputs["checkpoint_dir"]
    threads = torch.get_num_threads()
    # One thread: a 64-wide model gains nothing from more, and on a busy machine waiting threads cost 10x.
    yield {**inputs, "reward_dir": reward_dir, "threads": 1}
    torch.set_num_threads(threads)


def _run(inputs, tmp_path, name):
    from snaketrl.train.run import train_run

    train_run(**inputs, out_dir=tmp_path / name, checkpoint_dir=tmp_path / f"ckpt-{name}")
    return _outputs(tmp_path / name)


def _outputs(out):
    from safetensors.torch import load_file

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {"log": [{k: v for k, v in entry.items() if k not in CLOCK} for entry in history],
            "adapter": load_file(out / "adapter" / "adapter_model.safetensors"),
            "samples": read_jsonl(out / "training_samples.jsonl")}


def _assert_same(a, b):
    assert a["log"] == b["log"]  # json.loads gives every NaN as one object (val/ratio_var of one minibatch)
    assert a["adapter"].keys() == b["adapter"].keys()
    assert all(a["adapter"][k].equal(b["adapter"][k]) for k in a["adapter"])
    assert a["samples"] == b["samples"]


def test_killed_ppo_resumes_to_the_uninterrupted_result(ppo_inputs, tmp_path):
    _interrupt_at_step_4(ppo_inputs, tmp_path)
    checkpoint = tmp_path / "ckpt" / "checkpoint-3"
    assert {"adapter_model.safetensors", "value_model.safetensors", "optimizer.pt", "scheduler.pt",
            "rng_state.pth", "ppo_data_0.pt", "trainer_state.json"} <= {p.name for p in checkpoint.iterdir()}

    from transformers import TrainerCallback

    from snaketrl.train.run import train_run

    class Saves(TrainerCallback):
        steps = []

        def on_save(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    train_run(**ppo_inputs, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", callbacks=[Saves()])
    resumed = _outputs(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["resumed_from"] == str(checkpoint)
    assert Saves.steps == [6]  # save_steps counts global updates after a resume too

    uninterrupted = _run(ppo_inputs, tmp_path, "whole")
    updates = [e for e in uninterrupted["log"] if "objective/rlhf_reward" in e]
    assert [e["step"] for e in updates] == [1, 2, 3, 4, 5, 6]
    assert [e["episode"] for e in updates] == [4, 8, 12, 16, 20, 24]
    assert uninterrupted["log"][-1] == {"global_step": 6, "step": 6}  # the summary, less its runtime
    assert sorted({row["step"] for row in uninterrupted["samples"]}) == [1, 3, 5]
    _assert_same(resumed, uninterrupted)


def test_uninterrupted_run_is_trls_ppo(ppo_inputs, tmp_path, monkeypatch):
    from transformers.trainer_utils import TrainOutput
    from trl.experimental.ppo import PPOTrainer

    class Plain(PPOTrainer):
        """TRL's loop as it ships, called the way train_run calls a trainer."""

        def train(self, resume_from_checkpoint=None):
            assert resume_from_checkpoint is None
            gc.freeze()  # as snaketrl's class does, for speed alone
            try:
                super().train()
            finally:
                gc.unfreeze()
            self.state.log_history.append({"global_step": self.state.global_step, "step": self.state.global_step})
            return TrainOutput(self.state.global_step, None, {})

    with monkeypatch.context() as m:
        m.setitem(REGISTRY, "ppo", dataclasses.replace(REGISTRY["ppo"], trainer=f"{__name__}:Plain"))
        m.setitem(globals(), "Plain", Plain)
        trl = _run(ppo_inputs, tmp_path, "trl")
    ours = _run(ppo_inputs, tmp_path, "ours")
    assert len(ours["log"]) == 7 and len(ours["samples"]) == 3 * 4  # 6 updates + summary; 3 samplings of 4
    _assert_same(trl, ours)


def test_checkpoint_of_another_reward_model_is_not_resumed(ppo_inputs, tmp_path, caplog):
    import shutil

    from snaketrl.train.run import train_run

    _interrupt_at_step_4(ppo_inputs, tmp_path)
    shutil.copytree(ppo_inputs["reward_dir"], tmp_path / "reward2")
    with open(tmp_path / "reward2" / "config.json", "a") as f:
        f.write("\n")  # same model, other bytes: the content hash decides
    with caplog.at_level("WARNING", logger="snaketrl.train"):
        train_run(**{**ppo_inputs, "reward_dir": tmp_path / "reward2"}, out_dir=tmp_path / "out",
                  checkpoint_dir=tmp_path / "ckpt")
    assert "were made with another reward_model: starting over" in caplog.text
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["resumed_from"] is None
    assert [e["episode"] for e in _outputs(tmp_path / "out")["log"] if "episode" in e] == [4, 8, 12, 16, 20, 24]


def test_checkpoint_cut_short_is_set_aside(ppo_inputs, tmp_path, caplog):
    from snaketrl.train.run import train_run

    _interrupt_at_step_4(ppo_inputs, tmp_path)
    checkpoint = tmp_path / "ckpt" / "checkpoint-3"
    (checkpoint / "value_model.safetensors").unlink()  # as a lost node can leave it
    with caplog.at_level("WARNING", logger="snaketrl.train"):
        train_run(**ppo_inputs, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
    assert (f"t-ppo: {checkpoint} was cut short (it lacks value_model.safetensors): set aside (removed), never "
            f"resumed from" in caplog.text)
    assert ("t-ppo: the last attempt was cut short before a complete checkpoint: starting over at step 0; "
            "checkpoint-3 set aside" in caplog.text)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["resumed_from"] is None
    assert [e["episode"] for e in _outputs(tmp_path / "out")["log"] if "episode" in e] == [4, 8, 12, 16, 20, 24]


def test_fewer_prompts_than_one_batch_stop_in_one_line_before_training(ppo_inputs, tmp_path):
    """TRL's PPO loader drops a short batch and its loop repeats the loader forever: 3 prompts in batches of 4
    would hang. The job stops before the model trains, naming the file, the counts and the settings."""
    from snaketrl.errors import ConfigError
    from snaketrl.train.run import train_run

    write_jsonl(read_jsonl(ppo_inputs["train_file"])[:3], ppo_inputs["train_file"])
    with pytest.raises(ConfigError) as err:
        train_run(**ppo_inputs, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
    assert str(err.value) == (f"{ppo_inputs['train_file']}: 3 prompts for run '{ppo_inputs['run']['name']}', fewer "
                              f"than one PPO batch of 4 (per_device_train_batch_size 4 x gradient_accumulation_steps "
                              f"1): lower the batch or give datasets.{ppo_inputs['run']['dataset']} more rows")
    assert not (tmp_path / "out").exists()
