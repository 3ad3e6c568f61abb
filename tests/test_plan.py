"""A train job's plan (snaketrl.train.plan): everything it decides before any model loads, from its config, the
length stage's file, the device and the process group, checked here on devices the machine does not have."""

import copy
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from test_trainers import prepare

GIB = 2**30


def plan_of(tmp_path, config, tiny_model_dir, trainer, device, *, lengths=None, world=1, run=None, reward_dir=None,
            **run_extra):
    from snaketrl.train.plan import plan_run

    tmp_path.mkdir(parents=True, exist_ok=True)
    job = prepare(tmp_path, copy.deepcopy(config), tiny_model_dir, trainer, **run_extra)
    job["run"].update(run or {})
    if lengths:
        job["lengths_file"].write_text(json.dumps(lengths))
    return job, plan_run(job["run"], model_dir=job["model_dir"], lengths_file=job["lengths_file"],
                         train_file=job["train_file"], checkpoint_dir=job["checkpoint_dir"], device=device, world=world,
                         reward_dir=reward_dir)


def test_the_plan_module_imports_no_training_library():
    code = "import sys, snaketrl.train.plan; print([m for m in ('torch', 'transformers', 'trl') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_max_tokens_sets_the_steps_of_the_one_trl_config(tmp_path, config, tiny_model_dir):
    """The steps from max_tokens are in the TRL args the plan built once: budget / (rows x mean tokens)."""
    from snaketrl.train.plan import Device

    config = copy.deepcopy(config)
    config["training"]["max_steps"] = -1  # the run's steps come from its tokens
    _, plan = plan_of(tmp_path, config, tiny_model_dir, "sft", Device("cpu", False, 64 * GIB),
                      lengths={"max_length": 64, "mean_tokens": 20.0}, run={"max_tokens": 1000})
    rows = plan.args.per_device_train_batch_size * plan.args.gradient_accumulation_steps
    assert rows == 4 and plan.args.max_steps == 13  # ceil(1000 / (4 x 20))
    assert any(note.startswith("max_tokens 1000: at most 13 steps") for note in plan.notes)
    report = plan.report()
    numbers = {k: report.pop(k) for k in ("activation_estimate_bytes", "trained_state_estimate_bytes",
                                          "checkpointing_room_bytes", "estimate_tokens_per_forward")}
    assert report == {"device": "cpu", "batching": "padded", "row_groups": False,
                      "activation_checkpointing": False, "attn_implementation": "sdpa", "unpadded": False}
    # the numbers memory chose checkpointing from: 4 rows of 64 tokens, no value model, room below the free 64 GiB
    assert numbers["estimate_tokens_per_forward"] == 4 * 64 and numbers["trained_state_estimate_bytes"] == 0
    assert 0 < numbers["activation_estimate_bytes"] < numbers["checkpointing_room_bytes"] < 0.6 * 64 * GIB


@pytest.mark.parametrize("free, on", [(64 * GIB, False), (1024, True)])
def test_checkpointing_follows_the_device_memory_unless_the_config_sets_it(tmp_path, config, tiny_model_dir, free,
                                                                           on):
    from snaketrl.train.plan import Device

    job, plan = plan_of(tmp_path, config, tiny_model_dir, "dpo", Device("cpu", False, free))
    assert plan.checkpointing is on and plan.args.activation_checkpointing is on
    assert plan.args.gradient_checkpointing is on  # transformers mirrors the deprecated name
    assert any(note.startswith(f"activation checkpointing {'on' if on else 'off'}: ") for note in plan.notes)
    job["run"]["args"]["activation_checkpointing"] = True
    from snaketrl.train.plan import plan_run

    forced = plan_run(job["run"], model_dir=job["model_dir"], lengths_file=job["lengths_file"],
                      train_file=job["train_file"], checkpoint_dir=job["checkpoint_dir"],
                      device=Device("cpu", False, free))
    assert forced.checkpointing is True and not any("checkpointing" in note for note in forced.notes)


def test_a_jobs_memory_limit_below_the_estimate_turns_checkpointing_on(tmp_path, config, tiny_model_dir):
    """The room is the smaller of the device's free memory and the job's own limit (the train rule's mem_mb, the
    cgroup's): with 64 GiB free and a limit below the activations, checkpointing turns on and the note names the
    limit; the plan reports the numbers it compared."""
    from snaketrl.train.plan import Device

    _, free = plan_of(tmp_path / "a", config, tiny_model_dir, "dpo", Device("cpu", False, 64 * GIB))
    need = free.memory["activation_estimate_bytes"]
    limit = need // 2  # below the estimate, after the weights: no room at all
    _, limited = plan_of(tmp_path / "b", config, tiny_model_dir, "dpo",
                         Device("cpu", False, 64 * GIB, limit, "the job's mem_mb resource, 1"))
    assert free.checkpointing is False and limited.checkpointing is True
    assert limited.memory["memory_limit_bytes"] == limit and limited.memory["activation_estimate_bytes"] == need
    assert limited.memory["checkpointing_room_bytes"] < need < free.memory["checkpointing_room_bytes"]
    note = next(n for n in limited.notes if n.startswith("activation checkpointing on: "))
    assert f"of the job's mem_mb resource, 1 ({limit / GIB:.2f} GiB), below the device's free memory after the " \
           f"weights)" in note
    assert limited.report()["memory_limit_bytes"] == limit and "memory_limit_bytes" not in free.report()
    # a limit above the free memory leaves the free memory the room
    _, above = plan_of(tmp_path / "c", config, tiny_model_dir, "dpo",
                       Device("cpu", False, 64 * GIB, 128 * GIB, "the job's mem_mb resource, 137439"))
    assert above.memory["checkpointing_room_bytes"] == free.memory["checkpointing_room_bytes"]
    assert "of the free memory after the weights" in next(n for n in above.notes if "checkpointing" in n)


def test_the_memory_limit_is_the_smaller_of_mem_mb_and_the_cgroups(tmp_path):
    from snaketrl.train.memory import memory_limit_bytes

    v2, v1, absent = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes", tmp_path / "absent"
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    assert memory_limit_bytes(None, [absent, v2]) == (None, "")
    assert memory_limit_bytes(None, [absent, v1]) == (None, "")
    assert memory_limit_bytes(8000, [v2]) == (8 * 10 ** 9, "the job's mem_mb resource, 8000")
    v2.write_text(f"{6 * GIB}\n")
    assert memory_limit_bytes(8000, [v2]) == (6 * GIB, "the process's cgroup limit, 6.00 GiB")
    assert memory_limit_bytes(4000, [absent, v2]) == (4 * 10 ** 9, "the job's mem_mb resource, 4000")


def test_online_dpo_forwards_two_completions_of_each_prompt():
    """Online DPO's training forward runs each prompt's two completions (TRL's training_step): its tokens a forward
    are twice its batch's rows, each a prompt and max_new_tokens (it counted the batch's prompts alone)."""
    from types import SimpleNamespace

    from snaketrl.train.plan import forward_tokens, projected_tokens
    from snaketrl.trainers import REGISTRY

    fields = SimpleNamespace(per_device_train_batch_size=4, max_new_tokens=32)
    assert forward_tokens(REGISTRY["online_dpo"], fields, 160) == 2 * 4 * (160 + 32)
    assert projected_tokens("online_dpo", REGISTRY["online_dpo"], fields, 160) == 2 * 4 * (160 + 32)


def test_bf16_on_a_bf16_gpu_and_never_for_a_tiny_model_on_a_cpu(tmp_path, config, tiny_model_dir):
    from snaketrl.train.plan import Device

    _, cpu = plan_of(tmp_path, config, tiny_model_dir, "sft", Device("cpu", True, 64 * GIB))
    assert cpu.args.bf16 is False and cpu.args.fp16 is False


def test_the_length_stages_choice_for_this_device(tmp_path, config, tiny_model_dir):
    """A CPU takes the length stage's batching with its row groups, in the one TRL config."""
    from snaketrl.train.plan import Device

    grouped = {"max_length": 64, "batching_by_device": {"cpu": {
        "strategy": "grouped", "split_rows": True, "args": {"train_sampling_strategy": "group_by_length",
                                                            "remove_unused_columns": False,
                                                            "length_column_name": "snaketrl_length"}}}}
    _, one = plan_of(tmp_path / "a", config, tiny_model_dir, "dpo", Device("cpu", False, 64 * GIB), lengths=grouped)
    assert one.row_groups and one.report()["batching"] == "grouped" and one.batch == {"processes": 1}
    assert one.args.train_sampling_strategy == "group_by_length" and not one.unpadded


def test_a_reward_model_that_ships_its_code_is_loaded_with_it(tmp_path, config, tiny_model_dir):
    """TRL loads a GRPO run's reward model from its path with args.trust_remote_code: the plan sets it where the
    reward run's model entry trusts its code, and leaves the field at TRL's default elsewhere."""
    from snaketrl.train.plan import Device

    job, plain = plan_of(tmp_path / "a", config, tiny_model_dir, "grpo", Device("cpu", False, 64 * GIB))
    assert plain.args.trust_remote_code is False and "reward_trust_remote_code" not in job["run"]
    config = copy.deepcopy(config)
    config["models"]["qwen2-tiny"]["trust_remote_code"] = True
    job, trusted = plan_of(tmp_path / "b", config, tiny_model_dir, "grpo", Device("cpu", False, 64 * GIB),
                           reward_model="reward-qwen2-tiny")
    assert job["run"]["reward_trust_remote_code"] is True and trusted.args.trust_remote_code is True


def test_ppo_counts_one_chunk_of_logits_and_its_value_models_layers(tmp_path, config, tiny_model_dir, monkeypatch):
    """PPO's trained pass projects a chunk at a time (snaketrl.train.ppo.bound_logits) and runs the value model on the
    same tokens; GRPO's its completions in chunks that keep their logits up to logps.KEPT_LOGITS_BYTES; a model whose
    logits are softcapped keeps TRL's path, every position's logits at once."""
    import shutil

    from snaketrl.train import plan as planning
    from snaketrl.train.plan import Device

    seen, choose = [], planning.choose_checkpointing
    monkeypatch.setattr(planning, "choose_checkpointing", lambda *a, **k: seen.append(k) or choose(*a, **k))
    softcapped = tmp_path / "softcapped"
    shutil.copytree(tiny_model_dir, softcapped)
    model_config = json.loads((softcapped / "config.json").read_text())
    (softcapped / "config.json").write_text(json.dumps({**model_config, "final_logit_softcapping": 30.0}))
    chatml = tmp_path / "chatml"  # a template's added tokens: their rows train in a wrapped head
    shutil.copytree(tiny_model_dir, chatml)
    (chatml / "chat_template.json").write_text(json.dumps({"added_tokens": {"<|im_start|>": 1024}}))
    for name, trainer, model in (("ppo", "ppo", tiny_model_dir), ("capped", "ppo", softcapped),
                                 ("grpo", "grpo", tiny_model_dir), ("grpo-capped", "grpo", softcapped),
                                 ("grpo-chatml", "grpo", chatml)):
        plan_of(tmp_path / name, config, model, trainer, Device("cpu", False, 64 * GIB))
    assert [(k["chunked"], k["value_model"], k["kept"], k["trained_rows"]) for k in seen] == [
        (True, True, False, False), (False, True, False, False), (True, False, True, False),
        (False, False, True, False), (True, False, True, True)]


def with_added_rows(tmp_path, tiny_model_dir):
    """A copy of the tiny model whose chat template record names its `<|im_start|>` as added: that token's rows
    train (peft's trainable tokens in the embeddings and the head), as a template's added tokens' do."""
    import shutil

    from transformers import AutoTokenizer

    chatml = tmp_path / "chatml"
    if not chatml.exists():
        shutil.copytree(tiny_model_dir, chatml)
        start = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("<|im_start|>")
        (chatml / "chat_template.json").write_text(json.dumps({"added_tokens": {"<|im_start|>": start}}))
    return chatml


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "online_dpo"])
def test_the_plan_merges_the_trained_token_rows_of_an_online_trainers_generation(tmp_path, config, tiny_model_dir,
                                                                                  trainer):
    """A generating trainer whose model trains a chat template's added rows generates with them merged
    (snaketrl.train.generation.merge_rows_for_generation): on any device, a tiny model too. Not without added
    tokens, nor where lora.modules_to_save trains both layers whole (no rows are trainable tokens then); one of
    them whole leaves the other's rows."""
    from snaketrl.train.plan import Device

    chatml = with_added_rows(tmp_path, tiny_model_dir)
    # a GPU without bf16 units: TRL's config refuses bf16 on a machine without a GPU
    for name, device in (("cpu", Device("cpu", False, 64 * GIB)), ("cuda", Device("cuda", False, 80 * GIB))):
        _, plan = plan_of(tmp_path / name, config, chatml, trainer, device)
        assert plan.merged_token_rows is True and plan.report()["merged_token_rows"] is True
        assert any(note.startswith("generation with the trained token rows merged: unmerged, peft's trainable "
                                   "tokens build") for note in plan.notes)
    _, plain = plan_of(tmp_path / "plain", config, tiny_model_dir, trainer, Device("cpu", False, 64 * GIB))
    assert plain.merged_token_rows is False and "merged_token_rows" not in plain.report()
    for whole, merges in ((["embed_tokens", "lm_head"], False), (["lm_head"], True), (["embed_tokens"], True)):
        _, plan = plan_of(tmp_path / "-".join(whole), config, chatml, trainer, Device("cpu", False, 64 * GIB),
                          run={"lora": {"target_modules": ["q_proj", "v_proj"], "modules_to_save": whole}})
        assert plan.merged_token_rows is merges, whole


@pytest.mark.parametrize("trainer", ["sft", "dpo", "ppo"])
def test_a_trainer_that_does_not_generate_through_trl_merges_no_token_rows(tmp_path, config, tiny_model_dir, trainer):
    """SFT and DPO do not generate; PPO merges its rows in its own loop (snaketrl.train.ppo)."""
    from snaketrl.train.plan import Device

    _, plan = plan_of(tmp_path, config, with_added_rows(tmp_path, tiny_model_dir), trainer,
                      Device("cpu", False, 64 * GIB))
    assert plan.merged_token_rows is False and "merged_token_rows" not in plan.report()


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "online_dpo"])
def test_the_plan_has_a_reward_model_read_plain_prompts_with_eos(tmp_path, config, tiny_model_dir, trainer):
    """A GRPO, RLOO or online DPO run with a reward model and plain prompts: its reward model reads them with eos
    (snaketrl.train.reward_reading). Not with reward functions alone, nor prompts that are chats: made so by the
    config (chat) or in the train file, nor an empty train file."""
    from snaketrl.io import read_jsonl, write_jsonl
    from snaketrl.train.plan import Device

    cpu = Device("cpu", False, 64 * GIB)
    job, plan = plan_of(tmp_path / "model", config, tiny_model_dir, trainer, cpu, reward_dir=tiny_model_dir)
    assert isinstance(read_jsonl(job["train_file"])[0]["prompt"], str)
    assert plan.reward_read_as_trained is True and plan.report()["reward_read_as_trained"] is True
    assert any(note.startswith("the reward model reads plain prompts with eos: TRL scores plain text without the "
                               "eos") for note in plan.notes)
    _, funcs = plan_of(tmp_path / "funcs", config, tiny_model_dir, trainer, cpu)
    assert funcs.reward_read_as_trained is False and "reward_read_as_trained" not in funcs.report()
    _, chat = plan_of(tmp_path / "chat", config, tiny_model_dir, trainer, cpu, reward_dir=tiny_model_dir,
                      run={"chat": True})
    assert chat.reward_read_as_trained is False
    from snaketrl.data.chat import as_chat

    write_jsonl(as_chat(read_jsonl(job["train_file"])), job["train_file"])  # conversations in the file itself
    replan = dict(model_dir=job["model_dir"], lengths_file=job["lengths_file"], train_file=job["train_file"],
                  checkpoint_dir=job["checkpoint_dir"], device=cpu, reward_dir=tiny_model_dir)
    from snaketrl.train.plan import plan_run

    assert plan_run(job["run"], **replan).reward_read_as_trained is False
    job["train_file"].write_text("")
    assert plan_run(job["run"], **replan).reward_read_as_trained is False


def test_ppo_reads_its_reward_its_own_way(tmp_path, config, tiny_model_dir):
    """PPO's reward model reads a completion to its turn's end (snaketrl.train.ppo.score_to_turn_end), not this."""
    from snaketrl.train.plan import Device

    _, plan = plan_of(tmp_path, config, tiny_model_dir, "ppo", Device("cpu", False, 64 * GIB),
                      reward_dir=tiny_model_dir)
    assert plan.reward_read_as_trained is False and "reward_read_as_trained" not in plan.report()


def test_ppos_plan_counts_its_value_models_trained_state_and_its_two_reward_copies(tmp_path, config, tiny_model_dir):
    """PPO's value model, started from the reward run's model, trains every weight: the plan compares its
    activations and that state (a gradient and two AdamW moments a weight) with the room, which the reward and value
    models' weights leave smaller."""
    from snaketrl.train.memory import SHARE, parameter_count, weight_bytes
    from snaketrl.train.plan import Device

    _, plain = plan_of(tmp_path / "a", config, tiny_model_dir, "ppo", Device("cpu", False, 64 * GIB))
    _, ppo = plan_of(tmp_path / "b", config, tiny_model_dir, "ppo", Device("cpu", False, 64 * GIB),
                     reward_dir=tiny_model_dir)
    assert plain.memory["trained_state_estimate_bytes"] == 0  # no reward model given: nothing to count
    assert ppo.memory["trained_state_estimate_bytes"] == 3 * 4 * parameter_count(tiny_model_dir)  # fp32 tiny model
    assert ppo.memory["activation_estimate_bytes"] == plain.memory["activation_estimate_bytes"]
    weights = weight_bytes(tiny_model_dir)
    assert plain.memory["checkpointing_room_bytes"] - ppo.memory["checkpointing_room_bytes"] in range(
        int(SHARE * 2 * weights) - 1, int(SHARE * 2 * weights) + 2)
    assert "and the value model's gradients and optimizer states" in next(n for n in ppo.notes if "checkpoint" in n)


def test_a_kept_heap_doubles_the_logits_of_dpo_on_a_cpu_not_sfts_nor_a_samplers(tmp_path, config, tiny_model_dir,
                                                                                 monkeypatch):
    """A CPU job keeps what it frees unless its trainer samples (snaketrl.processes): DPO's unchunked logits count
    twice there; SFT's count of every position bounds it already; GRPO gives its memory back."""
    from snaketrl.train import plan as planning
    from snaketrl.train.plan import Device

    monkeypatch.delenv("SNAKETRL_KEEP_FREED_MEMORY", raising=False)
    seen, choose = [], planning.choose_checkpointing
    monkeypatch.setattr(planning, "choose_checkpointing", lambda *a, **k: seen.append(k) or choose(*a, **k))
    for trainer in ("dpo", "sft", "grpo"):
        plan_of(tmp_path / trainer, config, tiny_model_dir, trainer, Device("cpu", False, 64 * GIB))
    assert [k["heap_kept"] for k in seen] == [True, False, False]
