"""PPO's pad id is one no logit samples: TRL's loop takes every token equal to it for padding (issue 52)."""

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import rl  # noqa: E402


@pytest.fixture
def pad_sampling_model(tmp_path, tiny_model_dir):
    """The tiny model (nearly uniform over its 1,024 tokens) with its pad token's (tied) embedding row set to give
    the mean of its last hidden states over the shipped descriptiveness prompts a logit of 4: the policy samples
    the pad at about one position in ten."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketrl.io import read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.tie_word_embeddings  # one row: the pad's input embedding and its logit's weights
    prompts = [row["prompt"] for row in read_jsonl(ROOT / "data" / "samples" / "descriptiveness.jsonl")[:64]]
    with torch.no_grad():
        mean = torch.cat([model.model(**tokenizer(prompt, return_tensors="pt")).last_hidden_state[0]
                          for prompt in prompts]).mean(dim=0)
        model.get_input_embeddings().weight[tokenizer.pad_token_id] = 4 * mean / mean.dot(mean)
    out = tmp_path / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_sampled_pad_token_is_scored_as_trls_example_scores_it(tmp_path, config, pad_sampling_model, reward_dir,
                                                                 monkeypatch):
    """The first update of snaketrl's PPO job and of TRL's example script (bench/rl.py's arms; its "[PAD]" lies
    beyond the vocabulary) on the same prompts, seed and models, in fp32: the same completions, among them ones
    that sampled the workflow's pad token, and the same scores. snaketrl's job once padded with that token, so TRL's
    loop cut those completions there and the reward model scored what came before."""
    from efficiency import shipped
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import ppo_trainer

    from snaketrl.config import resolve_runs

    config["trainers"]["ppo"]["args"].update(per_device_train_batch_size=8, local_rollout_forward_batch_size=8,
                                             response_length=16, num_ppo_epochs=1, num_sample_generations=0)
    config["matrix"]["models"] = ["qwen2-tiny"]
    run = resolve_runs(config, shipped)["ppo-qwen2-tiny"]
    train, evals, lengths = rl.ppo_prompts(config, run, pad_sampling_model, tmp_path)
    rollouts, scores = {}, {}
    generate = ppo_trainer.batch_generation

    def recorded(model, queries, *args):
        out = generate(model, queries, *args)
        rollouts[arm] = out[0][:, queries.shape[1]:]
        return out

    class Scores(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            scores.setdefault(arm, []).extend([logs["objective/scores"]] if "objective/scores" in logs else [])

    monkeypatch.setattr(ppo_trainer, "batch_generation", recorded)
    for arm, measured in (("trl", rl.plain_trl_ppo), ("snaketrl", rl.snaketrl_job)):
        job = {"run": run, "arm": arm, "seed": 1, "model_dir": str(pad_sampling_model), "threads": 1,
               "train": str(train), "eval": str(evals), "lengths": str(lengths), "reward_dir": str(reward_dir),
               "work": str(tmp_path / arm), "schedule": rl.ppo_schedule(run, 1)}
        assert measured(job, [Scores()])["bf16"] is False

    tokenizer = AutoTokenizer.from_pretrained(pad_sampling_model)
    completions = rollouts["trl"]
    assert completions.equal(rollouts["snaketrl"])
    ended = (completions == tokenizer.eos_token_id).cumsum(dim=1) > 0
    assert ((completions == tokenizer.pad_token_id) & ~ended).any(dim=1).sum() >= 2  # sampled before any eos
    assert scores["snaketrl"] == pytest.approx(scores["trl"], abs=1e-6)
    assert len(scores["trl"]) == 1


@pytest.mark.parametrize("logits", [None, 6])
def test_the_pad_id_lies_at_or_beyond_the_logits(tiny_model_dir, logits):
    """A vocabulary as long as the logits (the tiny models, SmolLM2) gets the next id; one shorter (Qwen2.5: 151,665
    tokens, 151,936 logits; here 6 ids more) unused tokens up to the first id no logit samples. The workflow's own
    tokenizer keeps its pad."""
    from transformers import AutoTokenizer

    from snaketrl.train.ppo import PAD, unsampled_pad

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    size, pad = len(tokenizer), tokenizer.pad_token_id
    ppo = unsampled_pad(tokenizer, size + (logits or 0))
    assert (ppo.pad_token, ppo.pad_token_id, len(ppo)) == (PAD, size + (logits or 0), size + (logits or 0) + 1)
    assert (tokenizer.pad_token_id, len(tokenizer)) == (pad, size)
    assert ppo.eos_token_id == tokenizer.eos_token_id
    assert ppo.decode([5, ppo.pad_token_id], skip_special_tokens=True) == tokenizer.decode([5])
