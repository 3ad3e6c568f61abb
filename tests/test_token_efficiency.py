"""Token efficiency measured in training; the reward model's dropped pairs; switches that need a GPU."""

import json

import pytest

from conftest import ROOT
from snaketrl.config import ConfigError, resolve_runs
from snaketrl.data.lengths import histogram
from snaketrl.data.preprocess import preprocess
from snaketrl.io import read_jsonl, write_jsonl
from snaketrl.train.run import train_run


def _inputs(tmp_path, config, model_dir, trainer, dataset, layout, n_train, keep_share=0.99, round_to=8,
            batching="auto"):
    """A run of `trainer` on the first rows of a sample, with its length stage run as the workflow does."""
    rows = preprocess(read_jsonl(ROOT / f"data/samples/{dataset}.jsonl"), dataset=dataset, trainer=trainer,
                      layout=layout, columns={}, split="train").rows
    write_jsonl(rows[:n_train], tmp_path / "train.jsonl")
    write_jsonl(rows[n_train:n_train + 8], tmp_path / "eval.jsonl")
    settings = {"trainer": trainer, "layout": layout, "keep_share": keep_share, "round_to": round_to,
                "batch_size": 8, "seed": 0, "batching": batching, "attn_implementation": None}
    stats = histogram(model_dir, tmp_path / "train.jsonl", settings, tmp_path / "lengths.json",
                      tmp_path / "lengths.png", trainer)
    config["training"].update({"max_steps": 4, "logging_steps": 1, "eval_strategy": "no", "save_steps": 100})
    run = resolve_runs(config)[f"{trainer}-qwen2-tiny"]
    return stats, {"run": run, "model_dir": model_dir, "train_file": tmp_path / "train.jsonl",
                   "eval_file": tmp_path / "eval.jsonl", "lengths_file": tmp_path / "lengths.json",
                   "out_dir": tmp_path / "out", "checkpoint_dir": tmp_path / "ckpt"}


def test_sft_counts_every_token_trl_counts_and_drops_what_the_histogram_counted(config, tiny_model_dir, tmp_path):
    # max_length below some prompts' lengths: TRL drops those examples (nothing of their completion is left).
    stats, inputs = _inputs(tmp_path, config, tiny_model_dir, "sft", "tldr", "language_modeling", 64,
                            keep_share=0.3, round_to=1, batching="grouped")
    assert 0 < stats["dropped"] < 64
    metrics = train_run(**inputs)
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    # TRL counts the batches' attention-mask tokens itself (num_tokens, cumulative): the same real tokens.
    assert metrics["real_tokens"] == [e["num_tokens"] for e in state["log_history"] if "num_tokens" in e][-1]
    assert metrics["token_efficiency"] == metrics["real_tokens"] / metrics["processed_tokens"]
    assert 0.8 < metrics["token_efficiency"] < 1 and metrics["real_tokens_per_second"] > 0
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["token_efficiency"] == metrics["token_efficiency"]
    assert metrics["examples_dropped"] == stats["dropped"]
    # Its cost (snaketrl.train.cost): every FLOP trained, none forward-only; at least 4·N + 2·N_lora per padded
    # token (forward, activations' and LoRA's gradients), the head and attention on top; one record per step.
    weights = metrics["flop_weights"]["policy"]
    assert metrics["flops_forward_only"] == 0 and metrics["flops"] == metrics["flops_trained"]
    floor = (4 * weights["weights"] + 2 * weights["trainable"]) * metrics["processed_tokens"]
    attention = 3 * 4 * weights["layers"] * weights["attention_width"] * stats["max_length"]  # keys ≤ max_length
    assert floor < metrics["flops"] < floor + (4 * weights["head_weights"] + attention) * metrics["processed_tokens"]
    assert metrics["cost_by_step"]["step"] == [1, 2, 3, 4] and metrics["cost_by_step"]["flops"][-1] == metrics["flops"]
    assert metrics["peak_rss_bytes"] > 100 * 2**20 and metrics["train_seconds"] > 0
    # where training began, after the model loaded: below the peak, what the activation estimate is checked against
    assert 100 * 2**20 < metrics["train_begin_rss_bytes"] < metrics["peak_rss_bytes"]
    assert 100 * 2**20 < metrics["train_begin_peak_rss_bytes"] <= metrics["peak_rss_bytes"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["trl_args"]["train_sampling_strategy"] == "group_by_length"


def test_reward_model_drops_the_pairs_the_histogram_counted(config, tiny_model_dir, tmp_path):
    stats, inputs = _inputs(tmp_path, config, tiny_model_dir, "reward", "descriptiveness", "preference", 48,
                            keep_share=0.5, round_to=1, batching="grouped")
    assert 0 < stats["dropped"] < 48 and stats["max_length"] < stats["percentiles"]["p100"]
    metrics = train_run(**inputs)
    assert metrics["examples_dropped"] == stats["dropped"]
    # Grouped by the length column training added; TRL's batches hold chosen and rejected rows.
    assert metrics["token_efficiency"] == pytest.approx(stats["batching"]["expected_efficiency"], abs=0.1)


def test_dpo_pairs_run_in_row_groups_as_the_histogram_expects(config, tiny_model_dir, tmp_path):
    stats, inputs = _inputs(tmp_path, config, tiny_model_dir, "dpo", "ultrafeedback", "preference", 32,
                            batching="grouped")
    batching = stats["batching"]
    assert batching["split_rows"] and batching["expected_efficiency"] > batching["padding_efficiency"] + 0.1
    metrics = train_run(**inputs)  # 4 steps of 8: the whole epoch the histogram estimated
    assert metrics["token_efficiency"] > batching["padding_efficiency"] + 0.1
    assert metrics["token_efficiency"] == pytest.approx(batching["expected_efficiency"], abs=0.05)


@pytest.mark.parametrize("args, entry, message", [
    ({"use_liger_kernel": True}, {}, r"^config: run 'sft-qwen2-tiny': use_liger_kernel needs a CUDA GPU"),
    ({"activation_offloading": True}, {}, r"^config: run 'sft-qwen2-tiny': activation_offloading moves activations "
                                          r"from GPU to CPU memory and needs a CUDA GPU; none is visible$"),
    ({}, {"attn_implementation": "flash_attention_2"},
     r"^config: models.qwen2-tiny.attn_implementation: flash_attention_2 needs a CUDA GPU; none is visible$"),
])
def test_gpu_switches_fail_before_any_model_loads(config, tmp_path, args, entry, message):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    run = resolve_runs(config)["sft-qwen2-tiny"]
    run = {**run, "args": {**run["args"], **args}, "model_entry": {**run["model_entry"], **entry}}
    (tmp_path / "lengths.json").write_text(json.dumps({"max_length": 64}))
    missing = tmp_path / "no-model"  # loading any model from here would fail with another error
    with pytest.raises(ConfigError, match=message):
        train_run(run, model_dir=missing, train_file=missing, eval_file=missing, lengths_file=tmp_path / "lengths.json",
                  out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
