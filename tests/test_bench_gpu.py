"""bench/gpu.py's accounting, and its plain-TRL arm on CPU (the GPU table itself needs a GPU)."""

import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402

def test_peak_is_the_most_specific_device_name():
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert gpu.peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert gpu.peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert gpu.peak_flops("Some new card") is None


@pytest.mark.parametrize("trainer, arm", [("sft", "trl"), ("sft", "trl-packed"), ("sft", "trl-tuned"), ("dpo", "trl"),
                                          ("reward", "trl"), ("kto", "trl"), ("orpo", "trl")])
def test_the_plain_trl_arm_trains_with_trls_defaults(trainer, arm, tmp_path, config, tiny_model_dir):
    from test_trainers import prepare

    inputs = prepare(tmp_path, config, tiny_model_dir, trainer)
    run = inputs["run"]
    run["args"] = {k: v for k, v in run["args"].items() if k not in ("max_steps", "eval_strategy", "save_steps")}
    job = {"run": run, "arm": arm, "seed": 1, "model_dir": str(tiny_model_dir), "train": str(inputs["train_file"]),
           "eval": str(inputs["eval_file"]), "max_length": 64, "work": str(tmp_path / arm), "schedule": gpu.EPOCH,
           "profile": str(tmp_path / "profile.txt") if arm == "trl-tuned" else None}  # its epoch: 5 steps
    metrics = gpu.plain_trl(job)
    if job["profile"]:  # --profile: steps 3-5 in torch.profiler's tables, under the share the GPU computed
        assert re.match(r"3 steps: \d+\.\d+ s wall, GPU kernels 0\.000 s \(0% busy\)\n",
                        (tmp_path / "profile.txt").read_text())
    # TRL's default, which snaketrl decides from memory; the tuned arm turns it off
    assert metrics["activation_checkpointing"] is (arm != "trl-tuned")
    assert metrics["real_tokens"] > 0 and metrics["real_tokens_per_second"] > 0
    # MFU's numerator: the FLOPs counted as in every run, DPO's and KTO's reference forwards (adapter off) among them
    assert metrics["flops_trained"] > 0 and metrics["train_seconds"] > 0
    assert (metrics["flops_forward_only"] > 0) is (trainer in ("dpo", "kto"))
    assert metrics["flops"] == metrics["flops_trained"] + metrics["flops_forward_only"]
    if arm in gpu.PACKED:
        assert metrics["token_efficiency"] == pytest.approx(1.0)
    else:
        assert 0.3 < metrics["token_efficiency"] < 1.0  # random batches of 4 padded to their longest
    assert metrics["eval_loss"] > 0 and metrics["cpu_s"] > 0
    assert not list((tmp_path / arm / "out").glob("checkpoint-*"))  # no checkpoints: their writes are no batching's
