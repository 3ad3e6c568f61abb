"""What the tests call learning, measured one way for the tests and for bench/learning.py.

Each measure is a margin over "did not learn" (a drop in loss, a rise in reward, accuracy above chance), so a
threshold reads as the least margin a run must show. bench/learning.py measures every one over seeds and CPU
kernel paths (native, ATEN_CPU_CAPABILITY=avx2, =default; the last two with DNNL_MAX_CPU_ISA=AVX2); each
threshold below is at most half the worst margin it printed, and its comment gives that spread (worst / median,
over seeds 1, 2, 3, 42 x the three paths, both tiny models). A failing check names the run, seed, value,
threshold and the CPU capability torch ran with.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple


def thirds(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last third of a logged series."""
    n = max(1, len(values) // 3)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def logged(state: dict, key: str) -> list[float]:
    return [e[key] for e in state["log_history"] if key in e]


def rise(state: dict, key: str) -> float:
    first, last = thirds(logged(state, key))
    return last - first


def drop(state: dict, key: str) -> float:
    values = logged(state, key)
    return values[0] - values[-1]


class Check(NamedTuple):
    key: str  # short name in bench/learning.py's table
    what: str
    measure: Callable[[dict, dict], float]  # (trainer_state, metrics) -> margin
    threshold: float


# Each comment: the spread the threshold was set against, from `python bench/learning.py` (and `--unit`) on a
# 2-core AMD EPYC (AVX2): seeds 1, 2, 3, 42 x kernel paths native, avx2, default, both tiny models. Worst /
# median of the margin; the threshold is at most half the worst.

# The default workflow's runs, by trainer (and the tiny bases' pretraining).
WORKFLOW: dict[str, list[Check]] = {
    "sft": [
        # eval_loss drop: worst +0.055 (pythia, default path, seed 1), median +0.18
        Check("eval_loss drop", "eval loss, first minus last", lambda s, m: drop(s, "eval_loss"), 0.025),
        # thirds, not first and last step: one batch's loss moves by as much as the run learns (first minus
        # last: worst +0.010). Worst +0.030 (pythia, native seed 42), median +0.09
        Check("loss drop", "training loss, first third minus last third of the logged steps",
              lambda s, m: -rise(s, "loss"), 0.012),
    ],
    # accuracy 1.0 on the held-out pairs in every run (worst = median = +0.5)
    "dpo": [Check("accuracy - 0.5", "held-out preference accuracy minus chance (0.5)",
                  lambda s, m: m["eval_rewards/accuracies"] - 0.5, 0.25)],
    # accuracy 1.0 in every run (worst = median = +0.5)
    "reward": [Check("accuracy - 0.5", "held-out accuracy minus chance (0.5)",
                     lambda s, m: m["eval_accuracy"] - 0.5, 0.25)],
    # worst +0.367 (both models, seed 3), median +0.49; the SFT policy starts at 0.24-0.59 of 1
    "grpo": [Check("reward rise", "reward (keyword, 0 to 1), last third minus first third of the logged steps",
                   lambda s, m: rise(s, "reward"), 0.15)],
    # worst +0.96 (qwen2, default path, seed 42), median +3.3; the reward model's scores span about 10
    "ppo": [Check("rlhf_reward rise", "objective/rlhf_reward, last third minus first third of the logged steps",
                  lambda s, m: rise(s, "objective/rlhf_reward"), 0.45)],
    # worst +6.42, median +6.46 (ln 1024 = 6.93: held-out loss about 0.5 nats)
    "pretrain": [Check("ln V - eval_loss", "held-out loss below a uniform guess over the vocabulary (ln V)",
                       lambda s, m: m["ln_vocab"] - m["eval_loss"], 3.0)],
}

# The unit tests that assert learning (bench/learning.py --unit runs them with SNAKETRL_TEST_SEED). The three
# kernel paths gave the same values here to the last digit, and so did one thread (OMP_NUM_THREADS=1, as README
# line 2's workers run them) against two.
UNIT: dict[str, Check] = {
    # worst +0.178 (seed 1), median +0.22
    "test_sft_loss_falls_on_learnable_toy": Check(
        "toy sft loss drop", "training loss, first minus last logged", lambda s, m: drop(s, "loss"), 0.08),
    # accuracy 1.0 in every run
    "test_reward_model_loads_as_classifier_and_beats_chance": Check(
        "toy reward accuracy - 0.5", "held-out accuracy minus chance (0.5)",
        lambda s, m: m["eval_accuracy"] - 0.5, 0.25),
    # worst +4.25 (seed 42), median +4.30
    "test_pretraining_lowers_the_held_out_loss": Check(
        "toy pretrain ln V - eval_loss", "held-out loss below ln V", lambda s, m: m["ln_vocab"] - m["eval_loss"],
        2.0),
}


def seed(default: int) -> int:
    """A unit test's seed: its own, unless bench/learning.py sets SNAKETRL_TEST_SEED to measure the spread."""
    return int(os.environ.get("SNAKETRL_TEST_SEED", default))


def numerics() -> str:
    """The kernel path this process runs: what decides its rounding on a CPU."""
    import torch

    isa = os.environ.get("DNNL_MAX_CPU_ISA")
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}" + (
        f", DNNL_MAX_CPU_ISA={isa}" if isa else "")


def check(name: str, check: Check, state: dict, metrics: dict, seed) -> None:
    """Assert the margin exceeds the threshold, with a message that says where it ran; with
    SNAKETRL_LEARNING_RECORD set, also append the measurement to that file (bench/learning.py collects them)."""
    value = check.measure(state, metrics)
    record = os.environ.get("SNAKETRL_LEARNING_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"name": f"{name}: {check.key}", "value": value, "threshold": check.threshold,
                                "seed": seed}) + "\n")
    assert value > check.threshold, (f"{name} (seed {seed}) did not learn: {check.what} = {value:.4f}, threshold "
                                     f"{check.threshold} ({numerics()})")
