"""models.<name>.chat_template: a model whose tokenizer has no chat template is given one where it is fetched (a
name, a Jinja file, or another model's tokenizer), with the special tokens it needs added and their embedding rows
trained; every stage then renders the same turns from the model directory."""

import json
import re

import pytest
from first_tokens import decoded, first_eval_prompt_ids, first_training_ids, read_manifest
from test_chat import TINY_EVAL_FIRST, TINY_FIRST

from snaketrl.config import chat_template_file, model_source_entry, resolve_runs
from snaketrl.errors import ConfigError, HubUnreachable
from snaketrl.models import chat_template
from snaketrl.models.download import download

LORA = {"target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A base model as a Hub snapshot has it: a byte-level BPE tokenizer without a chat template or ChatML's
    markers (bos = eos = <|endoftext|>, as GPT-2 and Pythia), random Qwen2 weights with an untied output projection."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from conftest import base_samples
    from snaketrl.models.tiny import corpus_texts

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_texts(base_samples()),
                            trainer=trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        pad_token="<|pad|>", model_max_length=512)
    config = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, tie_word_embeddings=False,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("base") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert not tokenizer.chat_template and "<|im_start|>" not in tokenizer.get_vocab()
    return out


@pytest.fixture(scope="module")
def chatml_dir(base_dir, tmp_path_factory):
    """The base model as the download_model job makes it with `chat_template: chatml`."""
    out = tmp_path_factory.mktemp("fetched") / "base"
    download("base", {"hub": str(base_dir), "chat_template": "chatml"}, out)
    return out


def embeddings(model_dir):
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    return weights["model.embed_tokens.weight"], weights["lm_head.weight"]


def test_chatml_is_given_once_where_the_model_is_fetched(base_dir, chatml_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(base_dir))
    record = json.loads((chatml_dir / "chat_template.json").read_text())
    assert record == {"chat_template": "chatml", "added_tokens": {"<|im_start|>": vocab, "<|im_end|>": vocab + 1},
                      "eos_token": "<|im_end|>", "replaced_eos_token": "<|endoftext|>", "vocab_size": [vocab, vocab + 2]}
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir)
    assert tokenizer.chat_template == chat_template.CHATML and tokenizer.eos_token_id == vocab + 1
    config = json.loads((chatml_dir / "config.json").read_text())
    generation = json.loads((chatml_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == vocab + 1
    (embed, head), (old_embed, old_head) = embeddings(chatml_dir), embeddings(base_dir)
    assert embed.shape[0] == head.shape[0] == vocab + 2
    assert (embed[:vocab] == old_embed).all() and (head[:vocab] == old_head).all()  # old rows as they were
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(vocab) == 2 and ids.count(vocab + 1) == 1  # each marker one token


def test_sft_trains_the_added_tokens_and_every_stage_renders_the_same_turns(chatml_dir, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from conftest import ROOT
    from snaketrl.data.chat import as_chat
    from snaketrl.data.lengths import histogram
    from snaketrl.evaluate.loading import load_for_eval
    from snaketrl.io import read_jsonl, write_jsonl

    entry = {"hub": "org/base", "chat_template": "chatml", "lora": LORA}
    ids, tokenizer = first_training_ids("sft", "base", entry, chatml_dir, tmp_path / "sft", steps=3, threads=1)
    assert [decoded(tokenizer, row) for row in ids] == TINY_FIRST["sft"]
    assert ids == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TINY_FIRST["sft"]]
    record = json.loads((chatml_dir / "chat_template.json").read_text())
    added = sorted(record["added_tokens"].values())
    manifest = read_manifest(tmp_path / "sft")
    assert manifest["chat_template"] == record
    adapter = tmp_path / "sft" / "out" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["trainable_token_indices"] == {
        "embed_tokens": added, "lm_head": added}
    # The added rows trained, in the input embeddings and the (untied) output projection; the evaluation's model
    # (base + adapter) reads them.
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    embed, head = embeddings(chatml_dir)
    delta = {name: next(v for k, v in weights.items() if name in k and "trainable_tokens_delta" in k)
             for name in ("embed_tokens", "lm_head")}
    assert delta["embed_tokens"].shape == delta["lm_head"].shape == (2, embed.shape[1])
    assert not torch.equal(delta["embed_tokens"], embed[added]) and not torch.equal(delta["lm_head"], head[added])
    loaded = load_for_eval(chatml_dir, adapter)
    with torch.no_grad():
        rows = loaded.model.get_input_embeddings()(torch.tensor([added]))[0]
    assert torch.allclose(rows, delta["embed_tokens"]) and not torch.allclose(rows, embed[added])
    # Merged (a later run's policy), the rows are in its weights and its record goes with it.
    from snaketrl.models.merge import merge

    merge(adapter, chatml_dir, tmp_path / "merged", threads=1)
    assert json.loads((tmp_path / "merged" / "chat_template.json").read_text()) == record
    merged_embed, merged_head = embeddings(tmp_path / "merged")
    assert torch.allclose(merged_embed[added], delta["embed_tokens"])
    assert torch.allclose(merged_head[added], delta["lm_head"])

    # The length stage and the evaluation render the same turns from the model directory.
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:8]
    write_jsonl(rows, tmp_path / "train.jsonl")
    settings = {"trainer": "sft", "layout": "language_modeling", "keep_share": 1.0, "round_to": 8, "batch_size": 4,
                "seed": 0, "batching": "auto", "attn_implementation": None, "chat": True}
    got = histogram(chatml_dir, tmp_path / "train.jsonl", settings, tmp_path / "h.json", tmp_path / "h.png", "t")
    tok = AutoTokenizer.from_pretrained(chatml_dir)
    rendered = tok.apply_chat_template([r["prompt"] + r["completion"] for r in as_chat(rows)], tokenize=False)
    assert all(text.startswith("<|im_start|>user\n") for text in rendered)
    assert got["percentiles"]["p100"] == max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in rendered)
    ids = first_eval_prompt_ids("base", chatml_dir, tmp_path / "eval", monkeypatch)
    assert decoded(tok, ids) == TINY_EVAL_FIRST and ids == tok(TINY_EVAL_FIRST, add_special_tokens=False)["input_ids"]


def test_a_jinja_file_another_tokenizer_or_a_named_template(base_dir, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(base_dir))
    # A Jinja file is set as written (TRL's chat_template_path): no tokens added.
    (tmp_path / "mine.jinja").write_text(chat_template.ZEPHYR)
    download("base", {"hub": str(base_dir), "chat_template": "mine.jinja"}, tmp_path / "file",
             template_source=str(tmp_path / "mine.jinja"))
    record = json.loads((tmp_path / "file" / "chat_template.json").read_text())
    assert record == {"chat_template": "mine.jinja", "added_tokens": {}, "eos_token": "<|endoftext|>",
                      "vocab_size": [vocab, vocab]}
    assert AutoTokenizer.from_pretrained(tmp_path / "file").chat_template == chat_template.ZEPHYR
    # Another model's tokenizer (TRL's clone_chat_template): its template, eos and the added tokens this one lacks.
    download("base", {"hub": str(base_dir), "chat_template": str(tiny_model_dir)}, tmp_path / "clone")
    record = json.loads((tmp_path / "clone" / "chat_template.json").read_text())
    assert sorted(record["added_tokens"]) == ["<|im_end|>", "<|im_start|>"] and record["eos_token"] == "<|im_end|>"
    assert AutoTokenizer.from_pretrained(tmp_path / "clone").chat_template == chat_template.CHATML
    assert embeddings(tmp_path / "clone")[0].shape[0] == vocab + 2
    # Llama 3's template (TRL's copy): its three markers, eos <|eot_id|>, the tokenizer's own bos first.
    download("base", {"hub": str(base_dir), "chat_template": "llama3"}, tmp_path / "llama3")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama3")
    assert list(json.loads((tmp_path / "llama3" / "chat_template.json").read_text())["added_tokens"]) == [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    # A Hub id, offline: the error names what to pre-download and where it goes.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match=r"^model 'base': cannot reach the Hugging Face Hub .* to fetch "
                                             r"'org/instruct'. On a machine with internet: `hf download org/instruct "
                                             r"--include .*--local-dir DIR`, copy DIR here and set "
                                             r"models.base.chat_template to DIR$"):
        download("base", {"hub": str(base_dir), "chat_template": "org/instruct"}, tmp_path / "hub")
    assert not (tmp_path / "hub").exists()


def with_base(config, entry):
    config["models"]["base"] = {"hub": "org/base", "lora": LORA, **entry}
    config["matrix"]["models"] = ["base", "qwen2-tiny"]
    config["evaluation"] = None
    return config


@pytest.mark.parametrize("entry, message", [
    ({"chat_template": "chatlm"},
     "models.base.chat_template: unknown template 'chatlm' (did you mean 'chatml'?); expected a template name "
     "(chatml, llama3, zephyr), a .jinja file, or another model's tokenizer (a local directory, or a Hub id org/name)"),
    ({"chat_template": "missing/mine.jinja"},
     "models.base.chat_template: file missing/mine.jinja does not exist"),
    ({"chat_template": "./missing-tokenizer"}, "models.base.chat_template: directory ./missing-tokenizer does not "
                                               "exist"),
])
def test_chat_templates_are_checked_at_parse_time(config, entry, message):
    with pytest.raises(ConfigError, match="^config: " + re.escape(message)):
        resolve_runs(with_base(config, entry))


def test_the_schema_wants_a_string(config):
    from conftest import ROOT
    from snaketrl.config import validate

    with pytest.raises(ConfigError, match=r"^config: models.base.chat_template: 3 is not of type 'string'$"):
        config["models"]["base"] = {"hub": "org/base", "chat_template": 3}
        validate(config, str(ROOT / "config" / "schema.yaml"))


def test_a_tiny_model_keeps_its_chatml(config):
    config["models"]["qwen2-tiny"]["chat_template"] = "chatml"
    with pytest.raises(ConfigError, match=r"^config: models.qwen2-tiny.chat_template: a tiny model's tokenizer ships "
                                          r"a ChatML template already; chat_template is for hub and gguf models$"):
        resolve_runs(config)


def test_the_template_decides_the_model_job_and_every_run(config, tmp_path):
    runs = resolve_runs(with_base(config, {"chat_template": "chatml"}))
    assert runs["sft-base"]["model_entry"]["chat_template"] == "chatml"
    # The download job's params: an edit of the template makes the model again (and so reruns what reads it).
    assert model_source_entry(config["models"]["base"]) == {"hub": "org/base", "chat_template": "chatml",
                                                        "chat_template_revision": chat_template.REVISION}
    assert chat_template_file(config["models"]["base"]) == {}  # a name: nothing to read
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert chat_template_file({"chat_template": "workflow:t.jinja"}, lambda rel: f"{tmp_path}/{rel}") == {
        "chat_template": f"{tmp_path}/t.jinja"}  # the job's input: an edit of the file makes the model again
    assert chat_template_file({"chat_template": "~/models/x"}) == {"chat_template": str(
        __import__("pathlib").Path.home() / "models/x")}


def test_a_tied_output_projection_follows_the_trained_rows(base_dir, tmp_path, monkeypatch):
    """Gemma 3 and the tiny Qwen2 tie their output projection to the embeddings: the added rows train once, and
    the projection reads them. A config that asks for TRL's chunked SFT loss is refused in one line."""
    import first_tokens
    import torch
    from transformers import AutoModelForCausalLM

    from snaketrl.evaluate.loading import load_for_eval

    model = AutoModelForCausalLM.from_pretrained(base_dir, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tied-base")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tied-base" / file).write_bytes((base_dir / file).read_bytes())
    download("tied", {"hub": str(tmp_path / "tied-base"), "chat_template": "chatml"}, tmp_path / "tied")
    entry = {"hub": "org/tied", "chat_template": "chatml", "lora": LORA}
    first_training_ids("sft", "tied", entry, tmp_path / "tied", tmp_path / "sft", steps=2, threads=1)
    adapter = tmp_path / "sft" / "out" / "adapter"
    added = sorted(json.loads((tmp_path / "tied" / "chat_template.json").read_text())["added_tokens"].values())
    loaded = load_for_eval(tmp_path / "tied", adapter)
    with torch.no_grad():
        rows = loaded.model.get_input_embeddings()(torch.tensor([added]))[0]
        hidden = torch.eye(rows.shape[1])[:2]
        logits = loaded.model.get_output_embeddings()(hidden)
    assert torch.allclose(logits[:, added], hidden @ rows.T)  # the projection's rows are the trained embeddings
    assert not torch.allclose(rows, AutoModelForCausalLM.from_pretrained(tmp_path / "tied").get_input_embeddings()
                              .weight[added])
    monkeypatch.setitem(first_tokens.ARGS, "sft", {"per_device_train_batch_size": 1, "loss_type": "chunked_nll"})
    with pytest.raises(ConfigError, match=r"^run 'run': loss_type chunked_nll reads the output projection's weight "
                                          r"itself and would miss the rows trained for the tokens "
                                          r"models.tied.chat_template added; use loss_type nll \(or leave it unset\)$"):
        first_training_ids("sft", "tied", entry, tmp_path / "tied", tmp_path / "chunked", steps=1, threads=1)


def test_zephyr_ends_turns_with_eos_and_needs_one(base_dir, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    download("base", {"hub": str(base_dir), "chat_template": "zephyr"}, tmp_path / "zephyr")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "zephyr")
    assert list(json.loads((tmp_path / "zephyr" / "chat_template.json").read_text())["added_tokens"]) == [
        "<|system|>", "<|user|>", "<|assistant|>"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True) == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, "[UNK]")),
                                   unk_token="[UNK]")
    with pytest.raises(ConfigError, match=r"^config: models.m.chat_template: zephyr ends each turn with the "
                                          r"tokenizer's eos token, and this model's tokenizer has none; use chatml or "
                                          r"llama3$"):
        chat_template.apply("m", "zephyr", AutoModelForCausalLM.from_pretrained(base_dir), bare)


def test_a_named_template_writes_bos_first_where_the_tokenizer_opens_every_text_with_it(base_dir):
    """Gemma's tokenizer starts every text with <bos> (its greedy answers without it are noise), and TRL tokenizes
    a rendered chat without special tokens: chatml and zephyr then write bos first. A tokenizer that adds none (the
    base's, GPT-2's) keeps the template as named (test_chatml_is_given_once_where_the_model_is_fetched)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name, first_turn in (("chatml", "<|im_start|>user\nhi<|im_end|>\n"), ("zephyr", "<|user|>\nhi<|endoftext|>\n")):
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tokenizer.bos_token_id)])
        assert tokenizer("hi")["input_ids"][0] == tokenizer.bos_token_id
        chat_template.apply("base", name, AutoModelForCausalLM.from_pretrained(base_dir), tokenizer)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert text == "<|endoftext|>" + first_turn
