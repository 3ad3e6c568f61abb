"""Training-time samples of GRPO and PPO reach a JSON Lines file through snaketrl.train.training_samples.attach."""

import pytest
from test_trainers import prepare

from snaketrl.io import read_jsonl
from snaketrl.rewards import unique_chars
from snaketrl.train import training_samples


@pytest.fixture
def hooked(monkeypatch, tmp_path):
    """train_run with its trainer hooked right after it is built, as the train job will do it."""
    import snaketrl.train.run as train

    path = tmp_path / "samples.jsonl"
    original = train.load

    def load(dotted):
        cls = original(dotted)
        if not isinstance(cls, type) or not dotted.endswith("Trainer"):
            return cls

        class Hooked(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.sampler = training_samples.attach(self, path, "t-run")

        return Hooked

    monkeypatch.setattr(train, "load", load)
    return path


def test_grpo_samples_every_generation_batch_with_its_rewards(hooked, tmp_path, config, tiny_model_dir):
    from snaketrl.train.run import train_run

    inputs = prepare(tmp_path, config, tiny_model_dir, "grpo")
    train_run(**inputs)
    rows = read_jsonl(hooked)
    train = [r for r in rows if r["mode"] == "train"]
    # 3 steps x a generation batch of 4 (2 prompts x num_generations 2), each batch once; then train_run's
    # final evaluate(): 4 eval prompts x 2, after step 3.
    assert [r["step"] for r in train] == [0] * 4 + [1] * 4 + [2] * 4
    assert [(r["mode"], r["step"]) for r in rows[12:]] == [("eval", 3)] * 8 and len(rows) == 20
    assert {r["run"] for r in rows} == {"t-run"}
    # The only reward function is unique_chars: the logged reward is its value on the logged completion.
    assert [r["reward"] for r in rows] == unique_chars([r["completion"] for r in rows])
    assert all(r["rewards"] == {"unique_chars": r["reward"]} for r in rows)
    assert training_samples.finish(hooked, tmp_path / "out" / "training_samples.jsonl") == 20


def test_ppo_sample_generations_are_kept(hooked, tmp_path, config, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from snaketrl.train.run import train_run

    judge = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    judge.config.pad_token_id = tok.pad_token_id
    judge.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    inputs = prepare(tmp_path, config, tiny_model_dir, "ppo")
    inputs["run"]["args"]["num_sample_generations"] = 3
    train_run(**inputs, reward_dir=tmp_path / "rm")
    rows = read_jsonl(hooked)
    assert rows and {r["mode"] for r in rows} == {"sample"}
    assert len({r["step"] for r in rows}) == 3  # one table per sample generation
    assert all(isinstance(r["reward"], float) and r["prompt"] and "<|pad|>" not in r["completion"] for r in rows)


def test_other_trainers_sample_nothing(tmp_path):
    class Plain:
        pass

    assert training_samples.attach(Plain(), tmp_path / "x.jsonl") is None
    assert training_samples.finish(tmp_path / "x.jsonl", tmp_path / "out.jsonl") == 0
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_a_resumed_run_keeps_the_samples_before_its_checkpoint(tmp_path):
    log = training_samples.SampleLog(tmp_path / "s.jsonl", "r")
    log.write(0, [{"completion": "a"}])
    log.write(1, [{"completion": "b"}])
    log.write(2, [{"completion": "c"}])
    resumed = training_samples.SampleLog(tmp_path / "s.jsonl", "r")
    resumed.write(2, [{"completion": "c2"}])  # the checkpoint was at step 2: step 2 is generated again
    assert [(r["step"], r["completion"]) for r in read_jsonl(tmp_path / "s.jsonl")] == [(0, "a"), (1, "b"), (2, "c2")]
