"""Pretraining the tiny random-init model: a few dozen steps on the samples, a few seconds on CPU."""

import json
import math

import learning
import pytest

from conftest import ROOT
from snaketrl.errors import DataError
from snaketrl.models.pretrain import generate_sample, pretrain, read_corpus

TLDR = ROOT / "data" / "samples" / "tldr.jsonl"
FAST = {"steps": 40, "batch_size": 8, "block_size": 64, "learning_rate": 3e-3, "seed": learning.seed(0), "threads": 2}


def log_losses(out_dir):
    state = json.loads((out_dir / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e], [
        e["eval_loss"] for e in state["log_history"] if "eval_loss" in e]


def test_pretraining_lowers_the_held_out_loss(tmp_path, tiny_model_dir):
    metrics = pretrain(tiny_model_dir, [TLDR], tmp_path / "out", **FAST)
    losses, eval_losses = log_losses(tmp_path / "out")
    assert metrics["ln_vocab"] == pytest.approx(math.log(1024))
    assert eval_losses[0] > eval_losses[-1] == metrics["eval_loss"]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    learning.check("pretrain toy", learning.UNIT["test_pretraining_lowers_the_held_out_loss"], state, metrics,
                   FAST["seed"])
    assert metrics["steps"] == 40 and metrics["tokens_seen"] == 40 * 8 * 64
    assert (tmp_path / "out" / "model.safetensors").is_file()
    text = generate_sample(tmp_path / "out", "SUBREDDIT: r/tifu\n\nTITLE:", max_new_tokens=8)
    assert isinstance(text, str) and text


def test_same_seed_same_losses(tmp_path, tiny_model_dir):
    short = {**FAST, "steps": 6, "logging_steps": 2}
    runs = [log_losses(pretrain(tiny_model_dir, [TLDR], tmp_path / d, **short) and tmp_path / d) for d in "ab"]
    assert runs[0] == runs[1] and len(runs[0][0]) == 3
    other = pretrain(tiny_model_dir, [TLDR], tmp_path / "c", **{**short, "seed": 1})
    assert log_losses(tmp_path / "c")[0] != runs[0][0] and other["steps"] == 6


def test_corpus_from_txt_and_jsonl(tmp_path, tiny_model_dir):
    txt = tmp_path / "notes.txt"
    txt.write_text("The first document.\nIts second line.\n\n\nThe second document.\n", encoding="utf-8")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"prompt": "TL;DR:", "completion": " short.", "n": 3}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n\n", encoding="utf-8")
    # A row is one document: its strings in order, a newline only where neither side has whitespace;
    # chat messages are rendered (here without a template: their contents).
    assert read_corpus([txt, jsonl]) == ["The first document.\nIts second line.", "The second document.",
                                         "TL;DR: short.", "Hi"]
    assert read_corpus([jsonl], render=lambda m: f"<{m[0]['role']}>")[1] == "<user>"
    metrics = pretrain(tiny_model_dir, [txt, jsonl, TLDR], tmp_path / "out", **{**FAST, "steps": 4})
    assert metrics["documents"] == 4 + 400 and math.isfinite(metrics["eval_loss"])


def test_missing_corpus_file_is_one_line_naming_it(tmp_path, tiny_model_dir):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(DataError, match=r"nowhere\.txt does not exist") as err:
        pretrain(tiny_model_dir, [TLDR, missing], tmp_path / "out", **FAST)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"notes\.csv: unsupported format '\.csv'"):
        read_corpus([tmp_path / "notes.csv"])


def test_diverging_pretraining_is_one_line_naming_the_model_and_writes_nothing(tmp_path, tiny_model_dir):
    from snaketrl.divergence import Diverged
    from snaketrl.models.pretrain import pretrain_model

    settings = {"steps": 10, "seed": 0, "block_size": 64, "batch_size": 8, "learning_rate": 1.0e+6, "eval_share": 0.1}
    out = tmp_path / "models" / "qwen2-tiny"
    with pytest.raises(Diverged, match=r"^model 'qwen2-tiny' diverged at step [1-9]: (loss|grad_norm|eval_loss) is "
                                       r"(nan|inf) \((last finite loss \d+\.\d\d at step \d|no finite loss logged "
                                       r"before); try a lower models\.qwen2-tiny\.tiny\.pretrain\.learning_rate\)$"):
        pretrain_model(tiny_model_dir, [TLDR], out, tmp_path / "state.json", tmp_path / "metrics.json", settings,
                       threads=2)
    assert not out.exists() and not list(out.parent.iterdir())  # no model, not even a temporary one
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "metrics.json").exists()
