"""A run that diverges stops with one line naming what went non-finite, where, and the usual causes."""

import json
import math
import re

import pytest
from test_trainers import prepare

from snaketrl.divergence import HINT, Divergence, Diverged, advice, describe, first_divergence
from snaketrl.smk import logged

NAN, INF = float("nan"), float("inf")


def test_nan_gradient_then_zero_loss_diverges_at_the_nan_step():
    # As the run logged it: transformers logs a window of NaN losses as 0.0.
    history = [{"loss": 6.9, "grad_norm": 1.2, "step": 1}, {"loss": 6.2, "grad_norm": NAN, "step": 5},
               {"loss": 0.0, "grad_norm": NAN, "step": 10}, {"train_loss": 0.344, "step": 10}]
    found = first_divergence(history)
    assert found == Divergence(5, "grad_norm is nan", ("loss", 6.2, 5))
    assert describe("run 'sft-qwen2-tiny'", found) == (
        "run 'sft-qwen2-tiny' diverged at step 5: grad_norm is nan (last finite loss 6.20 at step 5; try a lower "
        "learning_rate, max_grad_norm > 0, or bf16 off)")


def test_zero_loss_after_an_overflow_is_nan_under_fp16_loss_scaling():
    # fp16's scaler skips a step whose gradients overflow: the overflow alone is no divergence there.
    history = [{"loss": 3.1, "grad_norm": INF, "step": 2}, {"loss": 3.0, "grad_norm": 0.8, "step": 4},
               {"loss": 0.0, "grad_norm": 0.0, "step": 6}]
    assert first_divergence(history[:2], loss_scaling=True) is None
    assert first_divergence(history, loss_scaling=True) == Divergence(6, "loss is nan (logged as 0.0)",
                                                                      ("loss", 3.0, 4))
    assert first_divergence(history).problem == "grad_norm is inf"


def test_infinite_eval_loss_and_headline_metrics_diverge():
    from snaketrl.train.guard import watched

    assert first_divergence([{"loss": 2.0, "step": 2}, {"eval_loss": INF, "step": 2}]) == Divergence(
        2, "eval_loss is inf", ("loss", 2.0, 2))
    dpo = [{"loss": 0.69, "rewards/margins": 0.1, "step": 1}, {"eval_rewards/margins": -INF, "step": 1}]
    assert first_divergence(dpo, watched("dpo")).problem == "eval_rewards/margins is -inf"
    assert first_divergence(dpo, watched("sft")) is None  # not a metric SFT logs


def test_finite_logs_do_not_diverge():
    from snaketrl.train.guard import watched

    # GRPO's loss is exactly 0.0 at its first steps; PPO logs val/ratio_var NaN for a single minibatch.
    grpo = [{"loss": 0.0, "grad_norm": 0.4, "reward": 14.5, "step": 1}, {"loss": 0.03, "grad_norm": 0.5, "step": 2}]
    ppo = [{"loss/policy_avg": -0.01, "objective/kl": 0.0, "val/ratio_var": NAN, "step": 1}]
    assert first_divergence(grpo, watched("grpo")) is None
    assert first_divergence(ppo, watched("ppo")) is None
    assert describe("model 'm'", Divergence(1, "loss is nan")).endswith(f"(no finite loss logged before; {HINT})")


def test_the_rule_prints_one_line(tmp_path, capfd):
    from types import SimpleNamespace

    smk = SimpleNamespace(rule="train", log=[str(tmp_path / "train.log")])
    with pytest.raises(SystemExit), logged(smk, offline=False):
        raise Diverged(describe("run 'sft-qwen2-tiny'", Divergence(5, "grad_norm is nan", ("loss", 6.2, 5))))
    assert capfd.readouterr().err == (
        "snaketrl: error in rule train: run 'sft-qwen2-tiny' diverged at step 5: grad_norm is nan (last finite loss "
        "6.20 at step 5; try a lower learning_rate, max_grad_norm > 0, or bf16 off)\n")


# The planted settings; each trainer's own args where it needs them to diverge within a few steps.
PLANTED = {"learning_rate": 1.0e+6, "max_grad_norm": 0, "max_steps": 8, "save_steps": 1}
# Clipping is off there, so the advice names it; bf16 off only where the machine's bf16 turned it on.
PLANTED_ADVICE = f"({re.escape(advice(0, True))}|{re.escape(advice(0, False))})"
CASES = {
    "sft": ({}, "grad_norm"),
    "dpo": ({}, "grad_norm"),
    "reward": ({}, "grad_norm"),
    "grpo": ({}, "grad_norm"),
    # Four epochs of two minibatches: updates after the first see the broken policy within the same log.
    "ppo": ({"total_episodes": 32, "num_ppo_epochs": 4, "num_mini_batches": 2}, "loss/policy_avg"),
}


@pytest.fixture(autouse=True)
def _threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _planted(tmp_path, config, tiny_model_dir, trainer, reward=None):
    inputs = prepare(tmp_path, config, tiny_model_dir, trainer)
    inputs["run"]["args"].update(PLANTED)
    if trainer == "ppo":
        del inputs["run"]["args"]["max_steps"]
        inputs["reward_dir"] = reward
    # One thread: a 64-wide model gains nothing from more, and on a busy machine waiting threads cost 10x.
    return {**inputs, "threads": 1}


def _loss(key: str) -> str:
    return rf"\(last finite {re.escape(key)} -?\d+\.\d\d at step \d+|\(no finite loss logged before"


def _stopped_where_it_says(message: str, inputs) -> int:
    """The step the message names: where the marker's log ends with the named value non-finite, before any
    output was written and with the checkpoints before it kept."""
    from snaketrl.train.guard import MARKER

    step, key = re.search(r"diverged at step (\d+): (\S+) is", message).groups()
    saved = json.loads((inputs["checkpoint_dir"] / MARKER).read_text())
    assert saved["message"] == message and saved["step"] == int(step)
    last = [e for e in saved["log_history"] if key in e][-1]
    assert last["step"] == int(step) and not math.isfinite(last[key])
    _kept_before(int(step), inputs)
    return int(step)


def _kept_before(step: int, inputs) -> None:
    """Nothing written to out_dir; the checkpoints of the steps before `step` kept (one saved each step), none of
    the broken weights rotating the last finite one out."""
    assert not inputs["out_dir"].exists()
    kept = sorted(int(p.name.split("-")[1]) for p in inputs["checkpoint_dir"].glob("checkpoint-*"))
    assert kept == list(range(max(1, step - inputs["run"]["args"]["save_total_limit"]), step))


@pytest.mark.parametrize("trainer", CASES)
def test_planted_learning_rate_stops_training_with_one_line(trainer, tmp_path, config, tiny_model_dir, reward_dir):
    from snaketrl.train.run import train_run

    extra, key = CASES[trainer]
    inputs = _planted(tmp_path, config, tiny_model_dir, trainer, reward_dir)
    inputs["run"]["args"].update(extra)
    with pytest.raises(Diverged, match=rf"^run 't-{trainer}' diverged at step \d+: {re.escape(key)} is (nan|inf) "
                                       rf"({_loss('loss')}|{_loss('loss/policy_avg')}); {PLANTED_ADVICE}\)$") as err:
        train_run(**inputs)
    assert _stopped_where_it_says(str(err.value), inputs) < 8  # stopped there, not at the end


@pytest.mark.parametrize("checked", [True, False])
def test_ppo_sampling_from_a_broken_policy_is_divergence(checked, tmp_path, config, tiny_model_dir, reward_dir):
    """Checked (a step logged or saved): the update that broke the policy stops at its step end, its weights
    NaN. Unchecked: the broken policy shows first when the next update samples from it."""
    from snaketrl.train.guard import MARKER
    from snaketrl.train.run import train_run

    # One epoch per update.
    inputs = _planted(tmp_path, config, tiny_model_dir, "ppo", reward_dir)
    inputs["run"]["args"].update(total_episodes=32)
    if not checked:
        inputs["run"]["args"].update(logging_steps=100, save_steps=100)
    problem = "the trainable weights are nan" if checked else "the policy's sampling probabilities are nan or inf"
    with pytest.raises(Diverged, match=rf"^run 't-ppo' diverged at step \d+: {problem} ({_loss('loss/policy_avg')}|"
                                       rf"\(no finite loss logged before); {PLANTED_ADVICE}\)$") as err:
        train_run(**inputs)
    saved = json.loads((inputs["checkpoint_dir"] / MARKER).read_text())
    assert saved["message"] == str(err.value)
    if checked:
        assert saved["log_history"][-1]["step"] == saved["step"]  # that step's log, its loss still finite
        _kept_before(saved["step"], inputs)
    else:
        assert isinstance(err.value.__cause__, RuntimeError)
        assert saved["log_history"][-1]["step"] == saved["step"] - 1
        assert not list(inputs["checkpoint_dir"].glob("checkpoint-*"))
        assert not inputs["out_dir"].exists()


def test_a_diverged_run_is_not_resumed_until_its_config_changes(tmp_path, config, tiny_model_dir, caplog):
    from snaketrl.train.guard import MARKER
    from snaketrl.train.run import train_run

    inputs = _planted(tmp_path, config, tiny_model_dir, "sft")
    with pytest.raises(Diverged) as first:
        train_run(**inputs)
    step, problem = re.search(r"diverged at step (\d+): (.*?) \(", str(first.value)).groups()
    ckpt = inputs["checkpoint_dir"]
    with pytest.raises(Diverged, match=rf"^run 't-sft': its checkpoints in {re.escape(str(ckpt))} diverged at step "
                                       rf"{step} \({re.escape(problem)}\) with this same config and inputs; change its "
                                       rf"config \({PLANTED_ADVICE}\) or delete {re.escape(str(ckpt))} to start over$"):
        train_run(**inputs)
    assert not inputs["out_dir"].exists()

    inputs["run"]["args"].update(learning_rate=5e-3, max_grad_norm=1.0)
    with caplog.at_level("WARNING", logger="snaketrl.train"):
        metrics = train_run(**inputs)
    assert "were made with another config: starting over" in caplog.text
    assert json.loads((inputs["out_dir"] / "manifest.json").read_text())["resumed_from"] is None
    assert math.isfinite(metrics["eval_loss"]) and not (ckpt / MARKER).exists()


def test_advice_leaves_out_what_the_config_already_does():
    assert advice(0, True) == HINT
    assert advice(1.0, True) == "try a lower learning_rate or bf16 off"
    assert advice(None, False) == "try a lower learning_rate or max_grad_norm > 0"
    assert advice(1.0, False) == "try a lower learning_rate"


@pytest.mark.parametrize("trained, hint", [
    ({"max_grad_norm": 1.0, "bf16": False}, "try a lower learning_rate"),  # TRL's SFTConfig on CPU: nothing else
    ({"max_grad_norm": 0.0, "bf16": True}, HINT), ({"max_grad_norm": 1.0, "bf16": True}, advice(1.0, True)),
    (None, HINT),  # no manifest beside the adapter: every usual cause
])
def test_evaluating_a_diverged_run_advises_only_what_its_training_did_not_do(trained, hint, tmp_path):
    # The eval job read no config: it advised clipping and bf16 off to a run that had both.
    from trl import SFTConfig

    from snaketrl import paths
    from snaketrl.evaluate.job import check_finite
    from snaketrl.io import write_json

    adapter = tmp_path / paths.adapter("sft-m")
    adapter.mkdir(parents=True)
    if trained is not None:  # as train_run records them: its TRL config's to_dict()
        args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", **trained).to_dict() \
            if not trained["bf16"] else trained
        write_json({"trl_args": args}, tmp_path / paths.run_file("sft-m", "manifest.json"))
    target = {"kind": "run", "run": "sft-m", "model": "m", "trainer": "sft", "seed": 42, "reference": None}
    with pytest.raises(Diverged) as err:
        check_finite({"references": {"nll": NAN}}, target, adapter)
    assert str(err.value) == (f"evaluation of run 'sft-m': nll is nan; its model diverged in training: train it again "
                              f"({hint})")


@pytest.mark.parametrize("logging_steps, saved", [(10, 1), (2, 4)])
def test_nan_gradients_hidden_from_the_logged_loss_stop_at_that_step(
        logging_steps, saved, tmp_path, config, tiny_model_dir):
    """As Gemma 3's ORPO run: step 3's loss and gradients NaN, clipping on, no log showing it (no log before the
    end, or one whose loss transformers' logging_nan_inf_filter keeps finite); the guard stops at the first
    logged or saved step after, before that checkpoint is written, naming the weights; the advice leaves out the
    clipping the config has."""
    from transformers import TrainerCallback

    from snaketrl.train.guard import MARKER
    from snaketrl.train.run import train_run

    inputs = prepare(tmp_path, config, tiny_model_dir, "sft")
    inputs["run"]["args"].update(max_steps=6, logging_steps=logging_steps, save_steps=saved, max_grad_norm=1.0,
                                 save_total_limit=10)

    class NanStep(TrainerCallback):
        """Step 3's embeddings NaN (snaketrl's loss may read the head's weight, not call it): its loss and the
        LoRA weights' gradients; clipping a NaN norm and the optimizer step then make every trainable weight NaN."""

        hook = None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == 3:
                nan = float("nan")
                self.hook = model.get_input_embeddings().register_forward_hook(lambda module, i, out: out * nan)

        def on_step_end(self, args, state, control, **kwargs):
            if self.hook is not None:
                self.hook.remove()
                self.hook = None

    stop = 3 if saved == 1 else 4
    with pytest.raises(Diverged) as err:
        train_run(**inputs, threads=1, callbacks=[NanStep()])
    hint = f"({re.escape(advice(1.0, True))}|{re.escape(advice(1.0, False))})"
    # No log before the end: the weights name it. A log at step 4: its loss 0.0 (the filter's), its grad_norm NaN.
    problem, last = (("the trainable weights are nan", "no finite loss logged before") if logging_steps == 10
                     else ("grad_norm is nan", r"last finite loss \d+\.\d\d at step 2"))
    assert re.fullmatch(rf"run 't-sft' diverged at step {stop}: {problem} \({last}; {hint}\)", str(err.value))
    saved_marker = json.loads((inputs["checkpoint_dir"] / MARKER).read_text())
    assert saved_marker["step"] == stop and saved_marker["message"] == str(err.value)
    logged = [(e["step"], e["loss"]) for e in saved_marker["log_history"] if "loss" in e]
    assert [step for step, _ in logged] == ([] if logging_steps == 10 else [2, 4])
    assert all(math.isfinite(loss) for _, loss in logged) and [loss for _, loss in logged[1:]] == (
        [] if logging_steps == 10 else [0.0])  # the filter's stand-in for steps 3 and 4's NaN losses
    kept = sorted(int(p.name.split("-")[1]) for p in inputs["checkpoint_dir"].glob("checkpoint-*"))
    assert kept == list(range(saved, stop, saved))  # none of the NaN weights
    assert not inputs["out_dir"].exists()
    with pytest.raises(Diverged, match=rf"diverged at step {stop} \({problem}\) with this same config and "
                                       rf"inputs; change its config \({hint}\)"):
        train_run(**inputs, threads=1)


def test_a_finite_run_is_untouched(tmp_path, config, tiny_model_dir, monkeypatch):
    from transformers import TrainerCallback

    from snaketrl.train.guard import DivergenceGuard, MARKER
    from snaketrl.train.run import train_run

    def run(name):
        inputs = prepare(tmp_path / name, config, tiny_model_dir, "sft")
        inputs["run"]["args"].update(max_steps=4, save_steps=2)
        train_run(**inputs, threads=1)
        return json.loads((inputs["out_dir"] / "trainer_state.json").read_text())["log_history"], inputs

    (tmp_path / "guarded").mkdir()
    (tmp_path / "bare").mkdir()
    guarded, inputs = run("guarded")
    monkeypatch.setattr(DivergenceGuard, "on_log", TrainerCallback.on_log)  # the guard reads no log
    bare, _ = run("bare")
    losses = [[e["loss"] for e in history if "loss" in e] for history in (guarded, bare)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert not (inputs["checkpoint_dir"] / MARKER).exists()


@pytest.mark.parametrize("torn", ['{"run": "t-sft", "step": 3, "pro', '{"run": "t-sft"}'])
def test_a_torn_marker_still_refuses_the_resume_with_one_line(tmp_path, torn):
    """A marker is written only once a run diverged, so one cut short (by a version that wrote it in place) or
    damaged since still says so: the rerun refuses with the same advice, naming the unreadable marker, instead
    of failing with an internal JSON error."""
    from snaketrl.train.guard import MARKER, refuse_resume

    (tmp_path / MARKER).write_text(torn)
    why = "JSONDecodeError: Unterminated string" if torn.endswith("pro") else "KeyError: 'step'"
    with pytest.raises(Diverged, match=rf"^run 't-sft': its checkpoints in {tmp_path} diverged \(its marker "
                                       rf"{tmp_path}/{MARKER} is unreadable: {why}.*\) with this same config and "
                                       rf"inputs; change its config \({re.escape(HINT)}\) or delete {tmp_path} to "
                                       rf"start over$"):
        refuse_resume(tmp_path, "t-sft")


def _write_marker_and_die(checkpoint_dir) -> None:
    """A guard writing its marker, killed half-way through the write (os._exit: no cleanup runs)."""
    import os
    import pathlib
    from types import SimpleNamespace

    from snaketrl.train.guard import DivergenceGuard

    def half(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[:len(text) // 2])
        os._exit(3)

    pathlib.Path.write_text = half
    guard = DivergenceGuard("t-sft", "sft", checkpoint_dir)
    guard.divergence = Divergence(3, "grad_norm is nan", None)
    guard.state = SimpleNamespace(is_world_process_zero=True, log_history=[{"step": 3, "grad_norm": NAN}])
    guard.check()


def test_a_marker_write_killed_half_way_leaves_no_marker(tmp_path):
    import multiprocessing

    from snaketrl.train.guard import MARKER

    process = multiprocessing.get_context("fork").Process(target=_write_marker_and_die, args=(tmp_path,))
    process.start()
    process.join(60)
    assert process.exitcode == 3
    assert not (tmp_path / MARKER).exists()  # nothing a rerun would read; the half-written copy is a temporary
    assert [p.name for p in tmp_path.iterdir()] == [f".diverged.tmp{process.pid}.json"]
