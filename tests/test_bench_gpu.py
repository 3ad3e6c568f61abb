"""bench/gpu.py's accounting, and its plain-TRL arm on CPU (the GPU table itself needs a GPU)."""

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402

QWEN_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 4096}


def test_flops_per_token_of_a_qwen2_05b_shape_by_hand():
    # q and o: 896 x 896 each; k and v: 896 x 128 each (2 heads of 64); SwiGLU: 3 x 896 x 4864; head: 896 x 4096
    params = 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) + 896 * 4096
    assert params == 361_496_576
    scores = 2 * 2 * 24 * 896 * 1000 / 2  # 1000-token sequences, causal
    assert gpu.train_flops_per_token(QWEN_05B, 1000, checkpointing=False) == 2 * (2 * params + scores)
    assert gpu.train_flops_per_token(QWEN_05B, 1000, checkpointing=True) == 3 * (2 * params + scores)


def test_peak_is_the_most_specific_device_name():
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert gpu.peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert gpu.peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert gpu.peak_flops("Some new card") is None


@pytest.mark.parametrize("arm", ["trl", "trl-packed"])
def test_the_plain_trl_arm_trains_with_trls_defaults(arm, tmp_path, config, tiny_model_dir):
    from test_trainers import prepare

    inputs = prepare(tmp_path, config, tiny_model_dir, "sft")
    run = inputs["run"]
    run["args"] = {k: v for k, v in run["args"].items() if k not in ("max_steps", "eval_strategy", "save_steps")}
    job = {"run": run, "arm": arm, "seed": 1, "model_dir": str(tiny_model_dir), "train": str(inputs["train_file"]),
           "eval": str(inputs["eval_file"]), "max_length": 64, "work": str(tmp_path / arm), "schedule": gpu.EPOCH}
    metrics = gpu.plain_trl(job)
    assert metrics["activation_checkpointing"] is True  # TRL's default, which snaketrl decides from memory
    assert metrics["real_tokens"] > 0 and metrics["real_tokens_per_second"] > 0
    if arm == "trl-packed":
        assert metrics["token_efficiency"] == pytest.approx(1.0)
    else:
        assert 0.3 < metrics["token_efficiency"] < 1.0  # random batches of 4 padded to their longest
    assert metrics["eval_loss"] > 0 and metrics["cpu_s"] > 0
    assert not list((tmp_path / arm / "out").glob("checkpoint-*"))  # no checkpoints: their writes are no batching's
