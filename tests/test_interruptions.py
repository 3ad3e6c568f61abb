"""A rerun gives the uninterrupted result (snaketrl.train.checkpoints): one run per trainer family is killed
at every named point in turn (SIGKILL in a forked process, SNAKETRL_KILL_AT), its disk filled during a save,
rerun to the end, then forced to rerun; the forced rerun trains from the start, and both end with the same
log, metrics, training samples and adapter (bitwise)."""

import json
import multiprocessing
import os
import signal

import pytest
from test_ppo_resume import ARGS as PPO_ARGS
from test_trainers import prepare

from snaketrl.io import read_jsonl, write_jsonl

# Six steps, a checkpoint every 2, a log every 3 (checkpoints 2 and 4 fall between logs: the loss sum and
# TRL's metric lists are mid-way), an evaluation every 3 and at the start. 12 rows in batches of 4 are 3
# steps an epoch (GRPO: 8 prompts, 2 a step, 4 steps an epoch), so resumes land inside and at the start of an
# epoch.
STEPS = {"max_steps": 6, "save_steps": 2, "save_total_limit": 2, "logging_steps": 3, "eval_strategy": "steps",
         "eval_steps": 3, "eval_on_start": True}
PER_TRAINER = {"sft": ({}, 12), "dpo": ({}, 12), "reward": ({}, 12),
               "grpo": ({"eval_strategy": "no", "eval_on_start": False}, 8)}
KILLS = ["mid_step:3", "during_checkpoint_save:4", "after_checkpoint:4", "after_last_checkpoint", "final_eval",
         "writing_outputs"]
# PPO: 6 updates, a checkpoint every 3, no final evaluation (tests/test_ppo_resume.py)
PPO_KILLS = ["mid_step:4", "during_checkpoint_save:6", "after_last_checkpoint", "writing_outputs"]
STARTS = {"ppo": [0, 0, 3, 3, 6, 6], **{t: [0, 2, 2, 2, 4, 6, 6, 6] for t in PER_TRAINER}}


def clock(key: str) -> bool:
    """Wall-clock and memory figures: the only values a resumed run may report differently (a process's peak
    RSS depends on what it loaded before; the plan's room, on the free memory it saw)."""
    from snaketrl.train.cost import MEMORY_KEYS
    from snaketrl.train.memory import RESUMED_KEYS

    return (key.endswith(("_runtime", "_per_second", "step_time", "_seconds")) or key == "eps" or key in MEMORY_KEYS
            or key in RESUMED_KEYS)


def result(out) -> dict:
    from safetensors.torch import load_file

    state = json.loads((out / "trainer_state.json").read_text())
    state["log_history"] = [{k: v for k, v in e.items() if not clock(k)} for e in state["log_history"]]
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["cost_by_step"] = {k: v for k, v in metrics["cost_by_step"].items() if not clock(f"cost_{k}")}
    return {"state": state, "metrics": {k: v for k, v in metrics.items() if not clock(k)},
            "samples": read_jsonl(out / "training_samples.jsonl"),
            "adapter": load_file(out / "adapter" / "adapter_model.safetensors")}


def assert_same(a: dict, b: dict) -> None:
    assert a["state"]["log_history"] == b["state"]["log_history"]
    assert a["state"] == b["state"]
    assert a["metrics"] == b["metrics"]
    assert a["samples"] == b["samples"]
    assert a["adapter"].keys() == b["adapter"].keys()
    assert all(a["adapter"][k].equal(b["adapter"][k]) for k in a["adapter"])


def _child(job: dict, point: str) -> None:
    from snaketrl.train.run import train_run

    os.environ["SNAKETRL_KILL_AT"] = point
    train_run(**job)
    os._exit(0)  # reached only if the point never came


def killed(job: dict, point: str) -> None:
    """Run the job in a forked copy of this process (everything already imported) until it kills itself."""
    process = multiprocessing.get_context("fork").Process(target=_child, args=(job, point))
    process.start()
    process.join(600)
    assert process.exitcode == -signal.SIGKILL, f"{point}: the job ended with {process.exitcode}, not killed there"


def full_disk_at(monkeypatch, step: int) -> None:
    """torch's zip writer failing the way it does on a full disk, at checkpoint `step`'s optimizer."""
    import torch

    save = torch.save

    def failing(obj, f, *args, **kwargs):
        if str(f).endswith(f"checkpoint-{step}/optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 44032 vs 43924")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing)


@pytest.fixture
def job(request, tmp_path, config, tiny_model_dir, reward_dir):
    trainer = request.param
    inputs = prepare(tmp_path, config, tiny_model_dir, trainer)
    if trainer == "ppo":
        inputs["run"]["args"].update(PPO_ARGS)
        rows = 8
    else:
        args, rows = PER_TRAINER[trainer]
        inputs["run"]["args"].update({**STEPS, **args})
    write_jsonl(read_jsonl(inputs["train_file"])[:rows], inputs["train_file"])
    inputs["lengths_file"].write_text(json.dumps({"max_length": 96}))  # every SFT row kept: 3 steps an epoch
    # One thread: the forked jobs cannot use the parent's thread pool, and all runs must reduce alike.
    return {**inputs, "reward_dir": reward_dir if trainer == "ppo" else None, "threads": 1}


@pytest.mark.parametrize("job", ["sft", "dpo", "reward", "grpo", "ppo"], indirect=True)
def test_killed_anywhere_full_disk_and_forced_rerun_give_the_uninterrupted_result(job, monkeypatch, caplog):
    from snaketrl.errors import DiskFull
    from snaketrl.train.run import train_run

    trainer, ckpt, out = job["run"]["trainer"], job["checkpoint_dir"], job["out_dir"]
    ppo = trainer == "ppo"
    # PPO's first checkpoint is at 3: no complete one to measure, an estimate from the tensors instead
    need, basis, start = (("more than", "its trainable weights and optimizer state alone", "the start") if ppo else
                          ("about", "the size of checkpoint-2", "checkpoint-2"))
    with monkeypatch.context() as m:
        full_disk_at(m, 3 if ppo else 4)
        with pytest.raises(DiskFull, match=rf"^run 't-{trainer}': no space left on device for checkpoint "
                                           rf"{ckpt}/checkpoint-{3 if ppo else 4}: it needs "
                                           rf"{need} [\d,.]+ [KMG]iB \({basis}\), [\d,.]+ [KMG]iB free there; "
                                           rf"free some space and rerun: it resumes from {start}$") as full:
            train_run(**job)
    assert not (ckpt / f"checkpoint-{3 if ppo else 4}").exists()  # nothing half-written stays
    if not ppo:
        size = sum(p.stat().st_size for p in (ckpt / "checkpoint-2").rglob("*") if p.is_file()) / 1024
        assert f"it needs about {size:.1f} KiB (the size of checkpoint-2)" in str(full.value)
    for point in PPO_KILLS if ppo else KILLS:
        killed(job, point)
        if point.startswith("during_checkpoint_save"):
            partial = ckpt / f"checkpoint-{point.split(':')[1]}"
            assert {p.name for p in partial.iterdir()} >= {"adapter_model.safetensors"}
            assert not (partial / "optimizer.pt").exists() and not (partial / "trainer_state.json").exists()
    assert (out / "trainer_state.json").is_file() and not (out / "metrics.json").exists()  # written half-way

    with caplog.at_level("INFO", logger="snaketrl.train"):
        train_run(**job)
    last = "checkpoint-6"
    assert f"t-{trainer}: the last attempt was cut short: resuming from {last} at step 6" in caplog.text
    attempts = json.loads((out / "manifest.json").read_text())["attempts"]
    assert [a["started_at_step"] for a in attempts] == STARTS[trainer], attempts
    aside = next(a["set_aside"] for a in attempts if a["set_aside"])
    assert aside == {last if ppo else "checkpoint-4": "optimizer.pt, rng_state.pth, scheduler.pt, "
                     "snaketrl_checkpoint.json, snaketrl_state_0.pt, trainer_state.json"}
    assert not list(ckpt.glob("checkpoint-*"))  # a finished run leaves nothing to resume
    resumed = result(out)

    caplog.clear()
    with caplog.at_level("INFO", logger="snaketrl.train"):
        train_run(**job)
    assert (f"t-{trainer}: it finished before (a forced or triggered rerun): starting over at step 0"
            in caplog.text)
    attempts = json.loads((out / "manifest.json").read_text())["attempts"]
    assert [a["started_at_step"] for a in attempts] == [0] and attempts[0]["checkpoint"] is None
    forced = result(out)
    assert_same(resumed, forced)
    assert forced["metrics"]["real_tokens"] > 0 and len(forced["state"]["log_history"]) >= 3


def test_old_checkpoints_rotate_out_only_after_the_new_one_is_sealed(tmp_path, config, tiny_model_dir, monkeypatch):
    """transformers deletes checkpoints beyond save_total_limit inside the save, before snaketrl seals the new
    one: under a limit of 1 a kill there would leave no complete checkpoint. The rotation waits for the seal."""
    from transformers import TrainerCallback

    from snaketrl.train.checkpoints import Attempt
    from snaketrl.train.run import train_run

    inputs = prepare(tmp_path, config, tiny_model_dir, "sft")
    inputs["run"]["args"].update(max_steps=4, save_steps=2, save_total_limit=1)
    seen, seal = [], Attempt._seal

    def sealing(self, folder):
        seen.append(sorted(p.name for p in folder.parent.glob("checkpoint-*")))
        seal(self, folder)

    class Saved(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(sorted(p.name for p in inputs["checkpoint_dir"].glob("checkpoint-*")))

    monkeypatch.setattr(Attempt, "_seal", sealing)
    train_run(**inputs, threads=1, callbacks=[Saved()])
    assert seen == [["checkpoint-2"], ["checkpoint-2"], ["checkpoint-2", "checkpoint-4"], ["checkpoint-4"]]
    state = json.loads((inputs["out_dir"] / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and not list(inputs["checkpoint_dir"].glob("checkpoint-*"))


def test_a_checkpoint_damaged_in_place_is_set_aside_and_the_one_before_resumed(tmp_path, config, tiny_model_dir,
                                                                              monkeypatch, caplog):
    """A file of a sealed checkpoint whose bytes changed but not its size (a bad sector, a stray write) fails its
    sha256: that checkpoint counts as cut short, and the rerun resumes from the complete one before it."""
    from snaketrl.io import file_sha256
    from snaketrl.train.checkpoints import MARKER, STAMP, Attempt
    from snaketrl.train.run import train_run

    inputs = prepare(tmp_path, config, tiny_model_dir, "sft")
    inputs["run"]["args"].update(max_steps=4, save_steps=2, save_total_limit=2)
    monkeypatch.setattr(Attempt, "finish", lambda self: None)  # its checkpoints stay, as after a kill at the end
    train_run(**inputs, threads=1)
    ckpt = inputs["checkpoint_dir"]
    seal = json.loads((ckpt / "checkpoint-4" / MARKER).read_text())
    files = sorted(p.name for p in (ckpt / "checkpoint-4").iterdir() if p.name != MARKER)
    assert sorted(seal["sha256"]) == sorted(seal["files"]) == files
    assert seal["sha256"]["optimizer.pt"] == file_sha256(ckpt / "checkpoint-4" / "optimizer.pt")

    damaged = ckpt / "checkpoint-4" / "optimizer.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert damaged.stat().st_size == seal["files"]["optimizer.pt"]
    parts = json.loads((ckpt / STAMP).read_text())["parts"]
    with caplog.at_level("INFO", logger="snaketrl.train"):
        attempt = Attempt(ckpt, parts, "t-sft")
    assert attempt.resume == str(ckpt / "checkpoint-2")
    assert (f"t-sft: {ckpt}/checkpoint-4 was cut short (it lacks optimizer.pt (other bytes than sealed: its sha256 "
            f"differs)): set aside (removed), never resumed from") in caplog.text
    assert attempt.attempts[-1]["set_aside"] == {
        "checkpoint-4": "optimizer.pt (other bytes than sealed: its sha256 differs)"}


@pytest.mark.parametrize("job", ["sft", "ppo"], indirect=True)
def test_max_flops_stops_where_the_flops_reach_it_and_a_killed_run_stops_there_too(job, tmp_path):
    """A budget between the FLOPs counted by step 4 and by step 5 (an unbounded run's metrics) stops the run at
    step 5, with the unbounded run's per-step FLOPs up to there. Killed in step 4 and again after its stop,
    before its outputs (PPO's loop logs before its step end: it must stop there too, not an update later), the
    rerun resumes from a checkpoint before the stop (none is kept of the stopping step), adds the FLOPs it kept
    to the new ones, and ends as the uninterrupted run did."""
    from snaketrl.train.run import train_run

    unbounded = train_run(**{**job, "out_dir": tmp_path / "unbounded", "checkpoint_dir": tmp_path / "c-unbounded"})
    flops = unbounded["cost_by_step"]["flops"]  # cumulative, after steps 1 .. 6
    assert unbounded["cost_by_step"]["step"] == [1, 2, 3, 4, 5, 6] and flops == sorted(set(flops))
    job["run"] = {**job["run"], "max_flops": (flops[3] + flops[4]) / 2}
    whole = train_run(**{**job, "out_dir": tmp_path / "whole", "checkpoint_dir": tmp_path / "c-whole"})
    assert (whole["steps"], whole["max_flops_reached_at"]) == (5, 5)
    assert whole["cost_by_step"]["flops"] == flops[:5] and whole["flops"] == flops[4]
    assert json.loads((tmp_path / "whole" / "trainer_state.json").read_text())["global_step"] == 5

    killed(job, "mid_step:4")
    killed(job, "writing_outputs")
    assert not (job["checkpoint_dir"] / "checkpoint-5").exists()
    train_run(**job)
    starts = [a["started_at_step"] for a in json.loads((job["out_dir"] / "manifest.json").read_text())["attempts"]]
    assert starts == ([0, 3, 3] if job["run"]["trainer"] == "ppo" else [0, 2, 4])
    assert_same(result(job["out_dir"]), result(tmp_path / "whole"))
