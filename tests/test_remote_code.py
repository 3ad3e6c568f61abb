"""A model that ships its own code (models.<name>.trust_remote_code: true) goes through every stage that loads a
tokenizer or model: the length histogram and PPO's prompt tokenization, training, the merge, evaluation (the
model evaluated, and a reward model of it judging). Off, each of those loads is refused."""

import json
import shutil

import pytest
from test_trainers import prepare

from conftest import ROOT
from snaketrl.io import read_json, read_jsonl, write_jsonl

CONFIGURATION = '''from transformers import Qwen2Config


class SnakeTinyConfig(Qwen2Config):
    model_type = "snaketiny"
'''
MODELING = '''from torch import nn
from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2Model, Qwen2PreTrainedModel

from .configuration_snaketiny import SnakeTinyConfig


class SnakeTinyModel(Qwen2Model):
    config_class = SnakeTinyConfig


class SnakeTinyForCausalLM(Qwen2ForCausalLM):
    config_class = SnakeTinyConfig


class SnakeTinyForSequenceClassification(Qwen2ForSequenceClassification):
    config_class = SnakeTinyConfig

    def __init__(self, config):
        # Its own body: Qwen2's builds one with AutoModel.from_config, which knows no remote model type.
        Qwen2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = SnakeTinyModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
'''
TOKENIZATION = '''from transformers import TokenizersBackend


class SnakeTinyTokenizer(TokenizersBackend):
    pass
'''
AUTO_MAP = {"AutoConfig": "configuration_snaketiny.SnakeTinyConfig",
            "AutoModelForCausalLM": "modeling_snaketiny.SnakeTinyForCausalLM",
            "AutoModelForSequenceClassification": "modeling_snaketiny.SnakeTinyForSequenceClassification"}
REFUSED = "contains custom code which must be executed to correctly load the model"


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2 model as a model type transformers does not know, and its tokenizer as a class it does not
    know, their code shipped in its directory (as a Hub repository with `auto_map` has it). Without the flag
    transformers refuses both (the tokenizer's load reads the model's config)."""
    out = tmp_path_factory.mktemp("remote") / "snaketiny"
    shutil.copytree(tiny_model_dir, out)
    (out / "configuration_snaketiny.py").write_text(CONFIGURATION)
    (out / "modeling_snaketiny.py").write_text(MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="snaketiny", architectures=["SnakeTinyForCausalLM"], auto_map=AUTO_MAP)
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenization_snaketiny.py").write_text(TOKENIZATION)
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer.update(tokenizer_class="SnakeTinyTokenizer",
                     auto_map={"AutoTokenizer": [None, "tokenization_snaketiny.SnakeTinyTokenizer"]})
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return out


@pytest.fixture
def tokenizers(monkeypatch):
    """The class of each tokenizer loaded (SnakeTinyTokenizer only where its code was trusted)."""
    from transformers import AutoTokenizer

    load, loaded = AutoTokenizer.from_pretrained, []

    def spy(*args, **kwargs):
        tokenizer = load(*args, **kwargs)
        loaded.append(type(tokenizer).__name__)
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    return loaded


def _trusting(config):
    config["models"]["qwen2-tiny"]["trust_remote_code"] = True
    return config


def test_without_the_flag_transformers_refuses_the_model(custom_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    with pytest.raises(ValueError, match=REFUSED):
        AutoConfig.from_pretrained(custom_dir, trust_remote_code=False)
    with pytest.raises(ValueError, match=REFUSED):
        AutoModelForCausalLM.from_pretrained(custom_dir, trust_remote_code=False)
    assert type(AutoConfig.from_pretrained(custom_dir, trust_remote_code=True)).__name__ == "SnakeTinyConfig"


def test_the_length_stage_and_ppo_prompts_load_it_when_the_entry_trusts_it(tmp_path, config, custom_dir, tokenizers):
    from snaketrl.config import batching_of
    from snaketrl.data.lengths import histogram, tokenize_prompt_files
    from snaketrl.data.preprocess import preprocess

    rows = preprocess(read_jsonl(ROOT / "data/samples/tldr.jsonl")[:12], dataset="tldr", trainer="ppo",
                      layout="prompt", columns={}, split="train").rows
    write_jsonl(rows, tmp_path / "train.jsonl")
    settings = {"trainer": "ppo", "layout": "prompt", "keep_share": 0.99, "round_to": 32, "batch_size": 4,
                "seed": 0, "batching": batching_of(config, "ppo"), "attn_implementation": None}
    outputs = (tmp_path / "lengths.json", tmp_path / "lengths.png")
    with pytest.raises(ValueError, match=REFUSED):
        histogram(custom_dir, tmp_path / "train.jsonl", settings, *outputs, title="ppo / tldr / snaketiny")
    stats = histogram(custom_dir, tmp_path / "train.jsonl", {**settings, "trust_remote_code": True}, *outputs,
                      title="ppo / tldr / snaketiny")
    assert read_json(outputs[0]) == stats and stats["trust_remote_code"] is True and stats["max_length"] > 0

    # PPO's prompt tokenization learns it from the histogram's JSON (the one stage with no params of its own).
    tokenize_prompt_files(custom_dir, outputs[0], {"train": (tmp_path / "train.jsonl", tmp_path / "tok.jsonl")})
    tokenized = read_jsonl(tmp_path / "tok.jsonl")
    assert len(tokenized) == len(rows) and all(0 < len(r["input_ids"]) <= stats["max_length"] for r in tokenized)
    assert tokenizers == ["SnakeTinyTokenizer", "SnakeTinyTokenizer"]


def test_train_merge_and_evaluate_a_model_that_ships_its_code(tmp_path, config, custom_dir, tokenizers):
    from snaketrl.config.evaluation import check_evaluation, eval_targets
    from snaketrl.evaluate.job import evaluate
    from snaketrl.evaluate.loading import load_for_eval
    from snaketrl.models.merge import merge
    from snaketrl.remote_code import TRUSTED_JUDGES
    from snaketrl.train.run import train_run

    trained = {}
    for trainer in ("sft", "reward"):
        (tmp_path / trainer).mkdir()
        inputs = prepare(tmp_path / trainer, _trusting(config), custom_dir, trainer)
        assert inputs["run"]["model_entry"]["trust_remote_code"] is True
        inputs["run"]["args"].update(max_steps=2, save_steps=2, eval_strategy="no")
        metrics = train_run(**inputs, threads=1)
        assert json.loads((inputs["out_dir"] / "trainer_state.json").read_text())["global_step"] == 2
        assert metrics["train_loss"] > 0
        trained[trainer] = inputs

    merged = {}
    for trainer, task_type in (("sft", "CAUSAL_LM"), ("reward", "SEQ_CLS")):
        merged[trainer] = tmp_path / f"merged-{trainer}"
        with pytest.raises(ValueError, match=REFUSED):
            merge(trained[trainer]["out_dir"] / "adapter", custom_dir, merged[trainer], task_type, threads=1)
        assert not merged[trainer].exists()
        merge(trained[trainer]["out_dir"] / "adapter", custom_dir, merged[trainer], task_type, threads=1,
              trust_remote_code=True)
        # The merged model keeps its code: a run from it (or a judge) loads it the same way.
        assert json.loads((merged[trainer] / "config.json").read_text())["model_type"] == "snaketiny"
        assert (merged[trainer] / "modeling_snaketiny.py").is_file()
        assert (merged[trainer] / "tokenization_snaketiny.py").is_file()

    adapter = trained["sft"]["out_dir"] / "adapter"
    with pytest.raises(ValueError, match=REFUSED):
        load_for_eval(custom_dir, adapter, threads=1)
    assert type(load_for_eval(merged["sft"], threads=1, trust_remote_code=True).model).__name__ == \
        "SnakeTinyForCausalLM"

    # The eval job as the workflow runs it: its target says the model (and the judge's model) trusts its code.
    ev_config = {"prompts": {"dataset": "tldr", "size": 4}, "generation": {"max_new_tokens": 4, "batch_size": 4},
                 "reward_models": ["reward-qwen2-tiny"], "runs": ["t-sft"]}
    runs = {"t-sft": trained["sft"]["run"], "reward-qwen2-tiny": trained["reward"]["run"]}
    settings = check_evaluation(ev_config, runs, config["datasets"])
    target = eval_targets(settings, runs)["t-sft"]
    assert target["trust_remote_code"] is True and target[TRUSTED_JUDGES] == ["reward-qwen2-tiny"]
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")
    from snaketrl.data.preprocess import preprocess

    write_jsonl(preprocess(rows[-8:], dataset="tldr", trainer="grpo", layout="prompt", columns={},
                           split="eval").rows, tmp_path / "prompts.jsonl")
    job = dict(settings=settings, model_dir=custom_dir, adapter_dir=adapter, prompts_file=tmp_path / "prompts.jsonl",
               reward_models={"reward-qwen2-tiny": merged["reward"]}, threads=1,
               out_completions=tmp_path / "eval/completions.jsonl", out_metrics=tmp_path / "eval/metrics.json")
    with pytest.raises(ValueError, match=REFUSED):
        evaluate(target={k: v for k, v in target.items() if k != "trust_remote_code"}, **job)
    with pytest.raises(ValueError, match=REFUSED):  # the judge, loaded after generation
        evaluate(target={k: v for k, v in target.items() if k != TRUSTED_JUDGES}, **job)
    tokenizers.clear()
    metrics = evaluate(target=target, **job)
    assert tokenizers == ["SnakeTinyTokenizer", "SnakeTinyTokenizer"]  # the model's (its adapter's), the judge's
    assert metrics["n_prompts"] == 4 and len(read_jsonl(tmp_path / "eval/completions.jsonl")) == 4
    scores = [r["rm_reward_qwen2_tiny"] for r in read_jsonl(tmp_path / "eval/completions.jsonl")]
    assert list(metrics["scores"]) == ["rm_reward_qwen2_tiny"] and all(isinstance(v, float) for v in scores)
