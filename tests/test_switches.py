"""The memory guide's switches (QLoRA, Liger, activation offloading, packing) with every trainer: what a GPU run
found broken, fixed and checked on CPU where the CPU can reproduce it, refused at parse time where it cannot
work, and the whole trainer x switch matrix on CUDA (`pytest -m cuda` on a GPU machine; skipped elsewhere)."""

import importlib.util
import json
import math
import re

import pytest

from snaketrl.config import ConfigError, resolve_runs
from snaketrl.config.fields import init_fields
from snaketrl.trainers import REGISTRY
from test_trainers import prepare


def _qwen(seed=0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).train()


def _batch():
    """Right-padded rows of very different lengths: row groups split them in two."""
    import torch

    lens, width = [48, 44, 5, 3], 48
    ids, mask = torch.zeros(4, width, dtype=torch.long), torch.zeros(4, width, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(1, 64, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _fused_loss_forward(model):
    """What Liger's fused linear cross-entropy returns under TRL's SFTTrainer (no logits; the loss and the batch's
    token accuracy as one number each), computed in plain torch: Liger's Triton kernels need a GPU."""
    import torch.nn.functional as F
    from transformers.utils import ModelOutput

    def forward(input_ids, attention_mask, labels, num_items_in_batch=None, **kwargs):
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        target = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
        logits = model.lm_head(hidden).reshape(target.numel(), -1).float()
        valid = target != -100
        loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        loss = loss / (num_items_in_batch if num_items_in_batch is not None else valid.sum())
        accuracy = ((logits.argmax(-1) == target) & valid).sum() / valid.sum()
        return ModelOutput(loss=loss, token_accuracy=accuracy)

    model.forward = forward
    return model


@pytest.mark.parametrize("num_items", [False, True])
def test_row_groups_recombine_a_fused_loss_token_accuracy(num_items):
    import torch

    from snaketrl.train.batching import split_rows

    ids, mask, labels = _batch()
    # Rows 0 and 3 (one in each row group) labelled with the model's own predictions: accuracy 1 there, about
    # 1/64 elsewhere, so a group-unweighted mean would be off.
    with torch.no_grad():
        predicted = _qwen()(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    for row in (0, 3):
        labels[row, 1:] = torch.where(mask[row, 1:].bool(), predicted[row, :-1], labels[row, 1:])
    extra = {"num_items_in_batch": (labels[:, 1:] != -100).sum()} if num_items else {}
    whole = _fused_loss_forward(_qwen())(input_ids=ids, attention_mask=mask, labels=labels, **extra)
    split = split_rows(_fused_loss_forward(_qwen()))(input_ids=ids, attention_mask=mask, labels=labels, **extra)
    assert split.loss.item() == pytest.approx(whole.loss.item(), rel=1e-5)
    assert split.token_accuracy.item() == pytest.approx(whole.token_accuracy.item(), rel=1e-6)
    assert 0.4 < whole.token_accuracy.item() < 0.7


def test_token_counter_counts_a_decoder_run_without_the_model():
    """TRL's Liger DPO/KTO/GRPO losses run the decoder (model.base_model) directly, never the model's forward:
    the counter still sees the batch's real tokens (it counted 0, so token_efficiency 0.0, before)."""
    from peft import LoraConfig, get_peft_model

    from snaketrl.train.tokens import TokenCounter

    model = get_peft_model(_qwen(), LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"]))
    counter = TokenCounter(pad_token_id=0)
    counter.on_train_begin(None, None, None, model=model)
    ids, mask, _ = _batch()
    model.base_model.model.base_model(input_ids=ids, attention_mask=mask)
    assert (counter._real, counter._processed) == (int(mask.sum()), ids.numel())
    model(input_ids=ids, attention_mask=mask)  # the model's own forward runs the decoder once, counted once
    assert (counter._real, counter._processed) == (2 * int(mask.sum()), 2 * ids.numel())


def test_reward_runs_keep_liger_off_the_classifier_head(tmp_path):
    from snaketrl.train.args import build_args

    args = build_args("reward", {"use_liger_kernel": True}, output_dir=str(tmp_path), max_length=64, seed=0)
    assert args.liger_kernel_config == {"fused_linear_cross_entropy": False}
    assert build_args("sft", {"use_liger_kernel": True}, output_dir=str(tmp_path), max_length=64,
                      seed=0).liger_kernel_config is None


def test_ppo_trains_a_4bit_policy_in_bf16(tmp_path, tiny_model_dir):
    """The GPU run's `expected scalar type Float but found BFloat16` in lm_head, reproduced on CPU with
    bitsandbytes' CPU backend: TRL's PPO runs without autocast, and a 4-bit policy's norms stay fp32 while its
    lm_head is cast to bf16. snaketrl.train.ppo runs TRL's loop under bf16 autocast."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig

    from snaketrl.models.tokenizer import prepare_tokenizer
    from snaketrl.train.loading import load_model, quantization_config
    from snaketrl.train.ppo import PPOTrainer

    torch.manual_seed(0)
    reward = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    reward.save_pretrained(tmp_path / "reward")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "reward")
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quantization_config("4bit", True),
                                                  dtype=torch.bfloat16, device_map="cpu")
    policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False)  # as load_model does
    prompts = ["SUBREDDIT: r/test\n\nPOST: hello there", "What is 2+2?", "Tell me a story", "Why is the sky blue?"]
    ds = Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in prompts * 2]})
    args = PPOConfig(output_dir=str(tmp_path / "out"), bf16=True, total_episodes=8, per_device_train_batch_size=4,
                     local_rollout_forward_batch_size=4, response_length=4, num_ppo_epochs=1, num_sample_generations=0,
                     stop_token="eos", report_to="none", save_steps=1000, logging_steps=1, use_cpu=True)
    entry = {"trust_remote_code": False}
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None,
                         reward_model=load_model(tmp_path / "reward", "reward", entry, True, "SEQ_CLS"),
                         value_model=load_model(tmp_path / "reward", "value", entry, True, "SEQ_CLS"),
                         train_dataset=ds, eval_dataset=ds,
                         peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "objective/rlhf_reward" in h]
    assert len(logged) == 2 and all(math.isfinite(h["objective/rlhf_reward"]) for h in logged)


@pytest.mark.parametrize("trainer, args, entry, message", [
    ("ppo", {"use_liger_kernel": True}, {}, r"use_liger_kernel does nothing for PPO: TRL's PPOTrainer runs its own "
                                            r"loop"),
    ("sft", {"activation_offloading": True}, {"quantization": "4bit"},
     r"activation_offloading with models.qwen2-tiny.quantization 4bit: .* use activation_checkpointing_kwargs: "
     r"\{offload: true\}"),
])
def test_switches_that_cannot_work_are_refused_at_parse_time(config, trainer, args, entry, message):
    config["models"]["qwen2-tiny"].update(entry)
    config["trainers"][trainer].setdefault("args", {}).update(args)
    with pytest.raises(ConfigError, match=rf"^config: matrix \(run {trainer}-qwen2-tiny\): {message}"):
        resolve_runs(config)


# --- The length stage chooses for the device a run trains on -------------------------------------------

def test_cuda_packs_sft_and_groups_pairs_without_row_groups():
    import numpy as np

    from snaketrl.data.lengths import length_stats

    rng = np.random.default_rng(0)
    sft = rng.integers(20, 400, 200)
    pairs = np.stack([rng.integers(20, 400, 200), rng.integers(20, 60, 200)], axis=1)
    common = dict(keep_share=1.0, round_to=64, cap=512, batch_size=8, seed=0)
    s = length_stats(sft, trainer="sft", **common)["batching_by_device"]
    assert (s["cpu"]["strategy"], s["cuda"]["strategy"]) == ("grouped", "packed")
    assert s["cuda"]["args"] == {"packing": True, "packing_strategy": "bfd"} and s["cuda"]["device"] == "cuda"
    assert "1.4x" in s["cuda"]["reason"]
    d = length_stats(pairs, trainer="dpo", **common)
    assert d["batching"] == d["batching_by_device"]["cpu"]  # the histogram shows the CPU's
    cpu, cuda = d["batching_by_device"]["cpu"], d["batching_by_device"]["cuda"]
    assert (cpu["strategy"], cpu["split_rows"]) == ("grouped", True)
    assert (cuda["strategy"], cuda["split_rows"]) == ("grouped", False) and "no row groups on CUDA" in cuda["reason"]
    # Without row groups a grouped batch pads pairs to their longer side: less efficient than with them.
    assert d["padding_share"] > 0 and cpu["expected_efficiency"] > cuda["expected_efficiency"] > cuda[
        "padding_efficiency"]


def test_an_explicit_batching_is_kept_on_every_device():
    import numpy as np

    from snaketrl.data.lengths import length_stats

    lengths = np.random.default_rng(0).integers(20, 400, 200)
    s = length_stats(lengths, keep_share=1.0, round_to=64, cap=512, batch_size=8, seed=0, trainer="sft",
                     batching="padded")["batching_by_device"]
    assert s["cpu"]["strategy"] == s["cuda"]["strategy"] == "padded"


def test_a_histogram_without_this_devices_choice_is_not_read_as_another_devices(tmp_path, config, tiny_model_dir):
    """A histogram from before per-device choices holds only the CPU's ('batching'): row groups, which a GPU
    must not take. A GPU's plan names the file and the rerun, before any model loads."""
    from snaketrl.errors import TrainingError
    from snaketrl.train.plan import Device, plan_run

    inputs = prepare(tmp_path, config, tiny_model_dir, "dpo")
    inputs["lengths_file"].write_text(json.dumps({"max_length": 64, "batching": {
        "strategy": "grouped", "split_rows": True, "args": {"train_sampling_strategy": "group_by_length"}}}))
    plan = {key: inputs[key] for key in ("model_dir", "lengths_file", "train_file", "checkpoint_dir")}
    with pytest.raises(TrainingError, match=r"lengths\.json: no batching choice for cuda, only a CPU's .*"
                                            r"snakemake --forcerun length_histogram$"):
        plan_run(inputs["run"], **plan, device=Device("cuda", True, 80 * 2**30))
    assert plan_run(inputs["run"], **plan, device=Device("cpu", False, 8 * 2**30)).row_groups


# --- Activation checkpointing from memory ----------------------------------------------------------------

QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936}


def test_activation_estimate_of_a_qwen2_05b_batch():
    from snaketrl.train.memory import activation_bytes

    # 8 x 1568 tokens in bf16: 24 layers x (38 x 896 + 10 x 4864) bytes, plus fp32 logits thrice, per token
    tokens = 8 * 1568
    expected = tokens * (24 * (38 * 896 + 10 * 4864) + 12 * 151936)
    assert activation_bytes(QWEN_05B, tokens, 2) == expected
    assert 47e9 < expected < 48e9  # at Qwen's vocabulary the logits take 23 GB of it
    assert activation_bytes(QWEN_05B, tokens, 4) > activation_bytes(QWEN_05B, tokens, 2)


def saved_for_backward(model, ids) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one training forward (weights left out)."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_activation_estimate_is_what_autograd_keeps_per_layer(dtype):
    """The estimate's per-layer bytes (fitted on hidden 448-896, intermediate 2432-4864) against what autograd
    keeps in a LoRA run of a shape it was not fitted on: one layer's worth, from 3 layers minus 1."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketrl.train.memory import activation_bytes

    shape = {"model_type": "qwen2", "hidden_size": 640, "intermediate_size": 1728, "num_attention_heads": 10,
             "num_key_value_heads": 2, "vocab_size": 2048}
    ids = torch.randint(5, 2048, (2, 256), generator=torch.Generator().manual_seed(0))
    kept = {}
    for layers in (1, 3):
        torch.manual_seed(0)
        config = AutoConfig.for_model(**shape, num_hidden_layers=layers, attn_implementation="sdpa")
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
        kept[layers] = saved_for_backward(model, ids)
    size = 2 if dtype == "bfloat16" else 4
    per_layer = (kept[3] - kept[1]) / 2
    estimate = activation_bytes({**shape, "num_hidden_layers": 1}, ids.numel(), size) - \
        activation_bytes({**shape, "num_hidden_layers": 0}, ids.numel(), size)
    assert 1.0 <= estimate / per_layer < 1.05, (estimate, per_layer)
    # the logits: the fp32 log-softmax kept (4·V per token) of the estimate's 12·V
    logits = kept[1] - per_layer * 1
    assert activation_bytes({**shape, "num_hidden_layers": 0}, ids.numel(), size) >= logits


def test_checkpointing_only_where_activations_would_not_fit(tmp_path):
    from snaketrl.train.memory import choose_checkpointing

    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    on, why, _ = choose_checkpointing(tmp_path, 8 * 1568, 2, free=80 * 2 ** 30)  # an H100
    assert not on and "take about 44.48 GiB without checkpointing, against 48.00 GiB" in why
    on, why, _ = choose_checkpointing(tmp_path, 8 * 1568, 2, free=24 * 2 ** 30)  # a 24 GB card
    assert on and "against 14.40 GiB" in why


def test_a_run_that_sets_no_checkpointing_gets_it_from_memory(tmp_path, config, tiny_model_dir, caplog):
    """The default config leaves activation_checkpointing to the workflow: a tiny model's activations fit, so
    it is off (TRL's default is on: 1.5-3x slower on CPU), and metrics.json says so."""
    from snaketrl.train.run import train_run

    config["training"].pop("activation_checkpointing", None)
    inputs = prepare(tmp_path, config, tiny_model_dir, "sft")
    assert "activation_checkpointing" not in inputs["run"]["args"]
    with caplog.at_level("INFO", logger="snaketrl.train"):
        metrics = train_run(**inputs)
    assert metrics["activation_checkpointing"] is False and metrics["device"] == "cpu"
    assert any("activation checkpointing off: activations of 256 tokens" in r.message for r in caplog.records)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["trl_args"]["activation_checkpointing"] is False


# --- Every trainer under every switch, on CUDA -------------------------------------------------------------

# Each switch as the user writes it: TRL args, the model entry, and the length stage's choice for CUDA.
SWITCHES = {
    "bf16-lora": ({}, {}, None),
    "qlora-4bit": ({}, {"quantization": "4bit"}, None),
    "qlora-8bit": ({}, {"quantization": "8bit"}, None),
    "liger": ({"use_liger_kernel": True}, {}, None),
    "liger-4bit": ({"use_liger_kernel": True}, {"quantization": "4bit"}, None),
    "offloading": ({"activation_offloading": True}, {}, None),
    "packing": ({}, {}, {"strategy": "packed", "args": {"packing": True, "packing_strategy": "bfd"},
                         "split_rows": False}),
}


def expected_refusal(trainer: str, switch: str) -> str | None:
    """The one line a refused combination fails with, or None where it must train."""
    args, _, batching = SWITCHES[switch]
    fields = init_fields(REGISTRY[trainer].config)
    missing = next((key for key in args if key not in fields), None)
    if missing:
        return rf"^config: training\.{missing}: not a field of trl\."
    if trainer == "ppo" and args.get("use_liger_kernel"):
        return r"use_liger_kernel does nothing for PPO"
    return None


MATRIX = [(t, s) for t in sorted(REGISTRY) for s in SWITCHES if s != "packing" or "packed" in REGISTRY[t].batching]


@pytest.mark.cuda
@pytest.mark.parametrize("trainer, switch", MATRIX)
def test_every_trainer_under_every_switch_on_cuda(trainer, switch, tmp_path, config, tiny_model_dir, reward_dir):
    from snaketrl.train.run import train_run

    args, entry, batching = SWITCHES[switch]
    refusal = expected_refusal(trainer, switch)
    if args.get("use_liger_kernel") and refusal is None and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed here")  # its refusal is tested on CPU
    config["models"]["qwen2-tiny"].update(entry)
    config["training"].update(args)
    try:
        inputs = prepare(tmp_path, config, tiny_model_dir, trainer)
        if batching:
            (tmp_path / "lengths.json").write_text(json.dumps({"max_length": 64, "batching_by_device": {
                "cuda": batching}}))
        if REGISTRY[trainer].value_model:
            inputs["reward_dir"] = reward_dir
        metrics = train_run(**inputs)
    except ConfigError as err:
        assert refusal and re.search(refusal, str(err)), f"refused unexpectedly: {err}"
        assert not (tmp_path / "out").exists()
        return
    assert refusal is None, f"trained, but should have been refused with {refusal}"
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    losses = [v for h in state["log_history"] for k, v in h.items()
              if k in ("loss", "objective/rlhf_reward", "loss/policy_avg") and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), state["log_history"]
    assert metrics["device"] == "cuda" and metrics["real_tokens"] > 0
    assert 0 < metrics["token_efficiency"] <= 1 and metrics["real_tokens_per_second"] > 0
    # snaketrl.train.attention: torch's varlen kernel wherever the trainer does not generate
    assert metrics["attn_implementation"] == ("sdpa" if REGISTRY[trainer].generates else "varlen")
    if switch == "packing":
        assert metrics["batching"] == "packed" and metrics["token_efficiency"] == pytest.approx(1.0)


@pytest.mark.parametrize("device, attention", [
    ("cpu", "sdpa"),
    pytest.param("cuda", "sdpa", marks=pytest.mark.cuda),
    pytest.param("cuda", "flex_attention", marks=pytest.mark.cuda),
    pytest.param("cuda", "varlen", marks=pytest.mark.cuda)])
def test_packed_sequences_stay_apart_in_bf16(device, attention, tiny_model_dir):
    """What the CUDA choice rests on: a padding-free packed row (position_ids restarting per sequence, no
    attention mask, as TRL's collator builds it) gives each token of each sequence the loss it has alone, to
    bf16 rounding; the same row without position_ids (attention across neighbours) does not."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from snaketrl.train.attention import register

    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16,
                                                 attn_implementation=attention).to(device).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 1000, (n,), generator=g) for n in (37, 12, 64, 5, 29)]

    def loss(ids, positions=None):
        ids = ids.to(device)[None]
        kwargs = {} if positions is None else {"position_ids": positions.to(device)[None]}
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
        return F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")

    packed = loss(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]))
    blind = loss(torch.cat(seqs))
    start, leaks = 0, []
    for s in seqs:
        alone = loss(s)
        end = start + len(s)
        # Per token, largest |difference| to the sequence alone. Measured on CPU: packed 1.2e-4, blind 0.18-0.38
        # for every sequence after the first (the first sees no neighbour either way).
        assert (packed[start:end - 1] - alone).abs().max().item() < 5e-2
        leaks.append((blind[start:end - 1] - alone).abs().max().item())
        start = end
    assert min(leaks[1:]) > 0.1, leaks  # the test notices sequences that attend to each other


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_liger_without_its_package_is_refused_on_a_gpu_machine_in_one_line():
    from snaketrl.train.args import check_hardware

    with pytest.raises(ConfigError, match=r"^config: run 't': use_liger_kernel needs the liger-kernel package "
                                          r"\(pip install liger-kernel\)$"):
        check_hardware({"use_liger_kernel": True}, "t", cuda=True)
