"""PPO's logits bounded (snaketrl.train.ppo.bound_logits): TRL's logged values, with no tensor over the vocabulary
wider than a chunk of positions."""

import copy
import json

import pytest

CHUNK = 8  # positions of logits per chunk: an update's 4 rows x ~50 positions run in tens of chunks
VOCAB = 1024  # the tiny model's vocabulary (its widest layer is 128)


def widest_over_vocabulary():
    """A dispatch mode whose `rows` is the most rows (elements / VOCAB) of any tensor an operation returns over the
    vocabulary, forward and backward: the generation's scores, the passes' logits, their softmax and gradients.
    Views are not counted (the transposed output projection is one). Built here: collecting the tests imports no
    torch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class WidestOverVocabulary(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):
                return out
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == VOCAB:
                    self.rows = max(self.rows, tensor.numel() // VOCAB)
            return out

    return WidestOverVocabulary()


@pytest.mark.parametrize("bf16", [False, True])
def test_bounded_logits_give_trls_updates(tmp_path, config, tiny_model_dir, reward_dir, monkeypatch, bf16):
    """Three PPO updates of the tiny model (4 completions of 8 tokens each), with TRL's logits (they fit a chunk of
    64 MiB) and with chunks of 8 positions: the same completions, the same logged values (KL, entropies, scores,
    losses, ratios) to float rounding, and no tensor over the vocabulary of more than 8 rows where TRL's path holds
    the rollout's scores and every position's logits."""
    from trl.experimental.ppo import ppo_trainer

    from snaketrl.train import logps
    from snaketrl.train.run import train_run
    from test_trainers import prepare

    logs, rollouts, widest = {}, {}, {}
    generate = ppo_trainer.batch_generation

    def recorded(model, queries, *args):
        out = generate(model, queries, *args)
        rollouts.setdefault(name, []).append(out[0])
        return out

    for bounded in (False, True):
        name = "bounded" if bounded else "trl"
        (tmp_path / name).mkdir()
        job = prepare(tmp_path / name, copy.deepcopy(config), tiny_model_dir, "ppo")
        job["run"]["args"]["bf16"] = bf16
        job["reward_dir"] = reward_dir
        monkeypatch.setattr(ppo_trainer, "batch_generation", recorded)
        if bounded:
            monkeypatch.setattr(logps, "CHUNK_BYTES", CHUNK * VOCAB * 4)
        with widest_over_vocabulary() as mode:
            train_run(**job)
        monkeypatch.undo()
        widest[name] = mode.rows
        state = json.loads((job["out_dir"] / "trainer_state.json").read_text())
        logs[name] = [{k: v for k, v in h.items() if k != "eps"} for h in state["log_history"]
                      if "loss/policy_avg" in h]
    assert ppo_trainer.batch_generation is generate  # put back after training
    assert widest == {"trl": pytest.approx(widest["trl"]), "bounded": CHUNK}
    assert widest["trl"] >= 4 * (8 + 16)  # a pass's logits: 4 rows of prompt and completion
    assert len(logs["trl"]) == 3 and all(log["policy/entropy_avg"] > 1 for log in logs["trl"])
    for ours, trls in zip(rollouts["bounded"], rollouts["trl"], strict=True):
        assert ours.equal(trls)
    for ours, trls in zip(logs["bounded"], logs["trl"], strict=True):
        assert set(ours) == set(trls)
        assert ours == pytest.approx(trls, rel=1e-3 if bf16 else 1e-5, abs=1e-6,
                                    nan_ok=True)  # val/ratio_var: the variance of one value
