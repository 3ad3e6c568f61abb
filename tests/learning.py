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


# The default workflow's runs, by trainer (and the tiny bases' pretraining).
WORKFLOW: dict[str, list[Check]] = {
    "sft": [
        Check("eval_loss drop", "eval loss, first minus last", lambda s, m: drop(s, "eval_loss"), 0.0),
        Check("loss drop", "training loss, first minus last logged", lambda s, m: drop(s, "loss"), 0.0),
    ],
    "dpo": [Check("accuracy - 0.5", "held-out preference accuracy minus chance (0.5)",
                  lambda s, m: m["eval_rewards/accuracies"] - 0.5, 0.3)],
    "reward": [Check("accuracy - 0.5", "held-out accuracy minus chance (0.5)",
                     lambda s, m: m["eval_accuracy"] - 0.5, 0.3)],
    "grpo": [Check("reward rise", "reward (keyword, 0 to 1), last third minus first third of the logged steps",
                   lambda s, m: rise(s, "reward"), 0.1)],
    "ppo": [Check("rlhf_reward rise", "objective/rlhf_reward, last third minus first third of the logged steps",
                  lambda s, m: rise(s, "objective/rlhf_reward"), 0.15)],
    "pretrain": [Check("ln V - eval_loss", "held-out loss below a uniform guess over the vocabulary (ln V)",
                       lambda s, m: m["ln_vocab"] - m["eval_loss"], 4.93)],
}

# The unit tests that assert learning (bench/learning.py --unit runs them with SNAKETRL_TEST_SEED).
UNIT: dict[str, Check] = {
    "test_sft_loss_falls_on_learnable_toy": Check(
        "toy sft loss drop", "training loss, first minus last logged", lambda s, m: drop(s, "loss"), 0.1),
    "test_reward_model_loads_as_classifier_and_beats_chance": Check(
        "toy reward accuracy - 0.5", "held-out accuracy minus chance (0.5)",
        lambda s, m: m["eval_accuracy"] - 0.5, 0.3),
    "test_pretraining_lowers_the_held_out_loss": Check(
        "toy pretrain ln V - eval_loss", "held-out loss below ln V", lambda s, m: m["ln_vocab"] - m["eval_loss"],
        2.93),
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
