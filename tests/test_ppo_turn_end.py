"""PPO's reward model reads a chat completion to the end of its turn (snaketrl.train.ppo.turn_end, with_turn_end):
TRL's loop scores at the eos a completion was cut after, where a reward model trained on rendered chat turns
(`<|im_end|>\n` in ChatML) never saw a text end."""

import pytest


def chatml(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def test_the_turn_end_is_what_the_template_writes_after_eos(tiny_model_dir):
    from transformers import AutoTokenizer

    from snaketrl.train.ppo import turn_end

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    assert turn_end(tokenizer) == []  # no template: plain text, nothing after eos
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    assert turn_end(chatml(tokenizer)) == tokenizer("\n", add_special_tokens=False).input_ids != []
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    assert turn_end(tokenizer) == []  # a template that ends its turns at eos


def test_the_tail_follows_each_completion_that_ended_with_eos():
    import torch

    from snaketrl.train.ppo import with_turn_end

    eos, pad, tail = 2, 0, [7, 8]
    rows = torch.tensor([[5, 5, 9, 2, 0, 0],    # ended with eos, room for the tail
                         [5, 5, 9, 9, 9, 2],    # eos in the last column: the rows widen
                         [5, 5, 9, 9, 9, 9],    # no eos (cut at the cap): scored where it stops, as before
                         [5, 2, 9, 2, 0, 0]])   # an eos in the prompt does not count
    out = with_turn_end(rows, 2, eos, pad, tail)
    assert out.tolist() == [[5, 5, 9, 2, 7, 8, 0, 0],
                            [5, 5, 9, 9, 9, 2, 7, 8],
                            [5, 5, 9, 9, 9, 9, 0, 0],
                            [5, 2, 9, 2, 7, 8, 0, 0]]
    assert with_turn_end(rows, 2, eos, pad, []) is rows


@pytest.mark.parametrize("chat", [True, False])
def test_the_reward_model_alone_reads_to_the_turn_end_where_the_prompts_are_chat(chat, tmp_path, config,
                                                                                 tiny_model_dir, reward_dir,
                                                                                 monkeypatch):
    """A PPO job of a chat run scores every completion that ended with eos with the template's tail after it, the
    value model the rollout as TRL gives it; a plain run scores as TRL does."""
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    import snaketrl.train.ppo as ppo_module
    from snaketrl.train.run import train_run
    from test_trainers import PER_TRAINER, prepare

    seen = []
    get_reward = trl_ppo.get_reward

    def recorded(model, query_responses, pad_token_id, context_length):
        seen.append((type(model).__name__, query_responses.clone(), context_length))
        return get_reward(model, query_responses, pad_token_id, context_length)

    monkeypatch.setattr(trl_ppo, "get_reward", recorded)
    job = prepare(tmp_path, config, tiny_model_dir, "ppo",
                  args={**PER_TRAINER["ppo"], "per_device_train_batch_size": 4, "total_episodes": 4})
    job["run"]["chat"] = chat
    monkeypatch.setattr(ppo_module, "turn_end", lambda tokenizer: [7])  # the tiny tokenizer has no template
    train_run(**job, reward_dir=reward_dir)
    assert trl_ppo.get_reward is recorded  # put back after training
    assert len(seen) >= 2
    # TRL's loop calls the value model on the rollout, then the reward model on the cut responses
    value, reward = seen[0][1], seen[1][1]
    context = seen[1][2]
    eos = job_eos(job)
    ended = [row for row in range(reward.shape[0]) if (value[row, context:] == eos).any()]
    if chat:
        assert reward.shape[1] == value.shape[1] + 1
        for row in ended:
            end = int((reward[row, context:] == eos).int().argmax()) + context
            assert reward[row, end + 1].item() == 7
    else:
        assert reward.shape[1] == value.shape[1]


def job_eos(job):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(job["model_dir"]).eos_token_id
