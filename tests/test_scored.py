"""DPO's, KTO's and ORPO's logits bounded (snaketrl.train.scored): TRL's logged losses and metrics, and eval loss,
with no projection onto the vocabulary wider than a chunk."""

import copy
import json

import pytest

from snaketrl.train.run import train_run

CHUNK = 8  # positions of logits per chunk: a batch of 4 rows x ~40 positions runs in tens of chunks


@pytest.fixture(scope="module")
def confident_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with an output projection of its own that favours the samples' most frequent token: its
    logits far from uniform and its argmax often right, so that the entropy, mean logits and token accuracy TRL
    logs are not those of a uniform guess."""
    import collections

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import ROOT
    from snaketrl.io import read_jsonl

    out = tmp_path_factory.mktemp("confident")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = read_jsonl(ROOT / "data/samples/descriptiveness.jsonl")[:24]
    ids = tokenizer([r["prompt"] + r["chosen"] for r in rows])["input_ids"]
    frequent = collections.Counter(i for row in ids for i in row).most_common(1)[0][0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids[0]])).last_hidden_state[0].mean(0)
        head = torch.nn.Linear(hidden.shape[0], model.config.vocab_size, bias=False)
        head.weight.copy_(model.get_input_embeddings().weight * 20)
        head.weight[frequent] += 40 * hidden / hidden.norm() ** 2
    model.lm_head = head
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("trainer,real", [("dpo", False), ("dpo", True), ("kto", False), ("orpo", False)])
def test_bounded_logits_give_trls_losses_and_metrics(tmp_path, config, confident_model_dir, monkeypatch, trainer,
                                                    real):
    """Each trainer of the tiny model trains 3 steps and evaluates, with TRL's logits (they fit a chunk of 64 MiB)
    and with chunks of 8 positions: the same logged values to 1e-5, and no vocabulary-wide output of the head."""
    import torch.nn.functional as F
    from transformers import TrainerCallback

    from snaketrl.train import logps
    from test_trainers import prepare

    class Widest(TrainerCallback):
        def __init__(self):
            self.widest = 0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.get_output_embeddings().register_forward_hook(
                lambda module, inputs, out: setattr(self, "widest", max(self.widest, out.shape[-1])))

    chunks, linear = [], F.linear

    def counted(x, weight, bias=None):
        if weight.shape[0] == 1024:  # the tiny model's vocabulary: its layers are narrower
            chunks.append(x.shape[0])
        return linear(x, weight, bias)

    logs, evals = {}, {}
    for bounded in (False, True):
        name = "bounded" if bounded else "trl"
        (tmp_path / name).mkdir()
        job = prepare(tmp_path / name, copy.deepcopy(config), confident_model_dir, trainer)
        job["run"]["args"].update(eval_strategy="steps", eval_steps=3)
        if real:  # the tiny model's files, as a real model's entry names them: DPO's tails on a CPU
            job["run"]["model_entry"] = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
            job["run"]["args"]["bf16"] = False
        if bounded:
            monkeypatch.setattr(logps, "CHUNK_BYTES", CHUNK * 1024 * 4)
            monkeypatch.setattr(F, "linear", counted)
        widest = Widest()
        metrics = train_run(**job, callbacks=[widest])
        monkeypatch.undo()
        assert widest.widest == (64 if bounded else 1024)  # the hidden states pass the head; TRL's logits
        state = json.loads((job["out_dir"] / "trainer_state.json").read_text())
        logs[name] = [h for h in state["log_history"] if "loss" in h]
        evals[name] = metrics["eval_loss"]
    assert len(chunks) > 30 and max(chunks) == CHUNK
    assert len(logs["trl"]) == 3
    for ours, trls in zip(logs["bounded"], logs["trl"], strict=True):
        assert set(ours) == set(trls)
        assert {k: v for k, v in ours.items() if k != "step"} == pytest.approx(
            {k: v for k, v in trls.items() if k != "step"}, rel=1e-5, abs=1e-6), trainer
    assert evals["bounded"] == pytest.approx(evals["trl"], rel=1e-5)


def test_the_plan_counts_a_chunk_only_where_the_logits_will_be_chunked(tmp_path):
    """The memory estimate counts one chunk's logits only for a run bound_logits will chunk: where it keeps TRL's
    path (Liger, DPO's sft loss or weighting, a trained output projection: LoRA on it, or the rows a chat template
    added), every position's logits are held at once and an estimate of one chunk would leave checkpointing off."""
    from types import SimpleNamespace

    from snaketrl.models.chat_template import RECORD_FILE
    from snaketrl.train.scored import plans_chunks

    def args(**kw):
        return SimpleNamespace(**{"use_liger_kernel": False, "loss_type": ["sigmoid"], "use_weighting": False, **kw})

    lora = {"target_modules": ["q_proj", "v_proj"]}
    assert [plans_chunks(t, args(), lora, tmp_path) for t in ("dpo", "kto", "orpo", "sft", "grpo")] == [
        True, True, True, False, False]
    assert not plans_chunks("dpo", args(loss_type=["sigmoid", "sft"]), lora, tmp_path)
    assert not plans_chunks("dpo", args(loss_type="sft"), lora, tmp_path)
    assert not plans_chunks("dpo", args(use_weighting=True), lora, tmp_path)
    assert not plans_chunks("kto", args(use_liger_kernel=True), lora, tmp_path)
    assert not plans_chunks("orpo", args(), {"target_modules": ["q_proj", "lm_head"]}, tmp_path)
    assert not plans_chunks("orpo", args(), {**lora, "modules_to_save": ["lm_head"]}, tmp_path)
    (tmp_path / RECORD_FILE).write_text(json.dumps({"added_tokens": {"<|im_start|>": 256, "<|im_end|>": 257}}))
    assert not plans_chunks("dpo", args(), lora, tmp_path)
