import copy
import json
import os

import learning
import pytest

import snaketrl
from conftest import ROOT
from snaketrl.config import ConfigError, resolve_runs
from snaketrl.data.preprocess import preprocess
from snaketrl.io import read_jsonl, write_jsonl
from snaketrl.manifest import cpu_model as manifest_cpu_model
from snaketrl.train.args import build_args, check_args
from snaketrl.train.loading import check_lora_targets
from snaketrl.train.run import train_run


def test_unknown_trl_argument_suggests_the_field():
    with pytest.raises(ConfigError, match=r"^config: run 'sft-x': 'learning_rat' is not a field of "
                                          r"trl.SFTConfig; did you mean 'learning_rate'\?$"):
        check_args("sft", {"learning_rat": 1e-3}, run="sft-x")


def test_dpo_only_field_is_rejected_for_sft():
    with pytest.raises(ConfigError, match="'beta' is not a field of trl.SFTConfig"):
        check_args("sft", {"beta": 0.1})
    check_args("dpo", {"beta": 0.1})


def test_max_length_belongs_to_the_histogram():
    with pytest.raises(ConfigError, match="'max_length' is set by the length histogram"):
        check_args("dpo", {"max_length": 512})


def test_build_args_sets_hardware_and_histogram_fields(tmp_path):
    args = build_args("sft", {"learning_rate": 1e-3, "activation_checkpointing": False},
                      output_dir=str(tmp_path), max_length=96, seed=7)
    assert type(args).__name__ == "SFTConfig"
    assert args.max_length == 96 and args.seed == 7 and args.learning_rate == 1e-3
    import torch

    # TRL's default is True; the hardware decides (off without a bf16 GPU)
    assert args.bf16 is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert args.report_to == [] or args.report_to == "none" or args.report_to == ["none"]



def test_bf16_on_a_cpu_only_with_bf16_matrix_units_and_never_for_a_tiny_model(tmp_path, monkeypatch):
    """On a CPU, bf16 where oneDNN has bf16 matrix units (AVX512-BF16, AMX) and the model may use it (a real one);
    nowhere else: a config may only turn it off."""
    import torch

    from snaketrl.train import args as train_args

    if not torch.cuda.is_available():
        assert train_args.native_bf16() is torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert train_args.native_bf16(cpu=False) is False
    common = dict(output_dir=str(tmp_path), max_length=64, seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for units in (True, False):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda units=units: units)
        assert build_args("sft", {}, **common, cpu_bf16=True).bf16 is units
        assert build_args("sft", {}, **common, cpu_bf16=False).bf16 is False
        assert build_args("sft", {"bf16": False}, **common, cpu_bf16=True).bf16 is False


def test_a_real_model_on_a_cpu_with_bf16_units_trains_in_bf16(tmp_path, config, tiny_model_dir, monkeypatch):
    """The train job's side of it: a model that is not tiny, on a CPU whose oneDNN has bf16 matrix units (faked
    here; this CPU emulates bf16), loads its weights in bf16 and trains under bf16 autocast, and its manifest says
    so; the same model marked tiny stays in fp32."""
    import torch

    from test_trainers import prepare

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    dtypes = {}
    for tiny in (False, True):
        (tmp_path / str(tiny)).mkdir()
        job = prepare(tmp_path / str(tiny), copy.deepcopy(config), tiny_model_dir, "sft")
        if not tiny:
            job["run"]["model_entry"] = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
        metrics = train_run(**job)
        manifest = json.loads((job["out_dir"] / "manifest.json").read_text())
        dtypes[tiny] = manifest["numerics"]["dtype"]
        assert manifest["trl_args"]["bf16"] is not tiny and metrics["train_loss"] > 0
    assert dtypes == {False: "bfloat16", True: "float32"}


@pytest.mark.parametrize("trainer", ["dpo", "reward", "grpo", "ppo"])
def test_every_trainer_trains_a_real_model_in_bf16_on_a_cpu_with_bf16_units(trainer, tmp_path, config,
                                                                             tiny_model_dir, reward_dir, monkeypatch):
    """The other trainers on that path (faked units): bf16 weights and autocast, PPO's value model and reference
    included, as a real model trains on an AMX Xeon or an AVX512-BF16 EPYC, where the real tier runs this way."""
    import math

    import torch

    from test_trainers import EXPECTED, prepare

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    job = prepare(tmp_path, config, tiny_model_dir, trainer)
    job["run"]["model_entry"] = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
    train_run(**job, reward_dir=reward_dir if trainer == "ppo" else None)
    manifest = json.loads((job["out_dir"] / "manifest.json").read_text())
    state = json.loads((job["out_dir"] / "trainer_state.json").read_text())
    logged = [(k, v) for entry in state["log_history"] for k, v in entry.items() if k in EXPECTED[trainer]]
    assert manifest["numerics"]["dtype"] == "bfloat16" and manifest["trl_args"]["bf16"] is True
    assert state["global_step"] >= 3 and {k for k, _ in logged} == EXPECTED[trainer]
    assert all(math.isfinite(v) for _, v in logged)


def test_a_bf16_ppo_generates_from_its_updated_policy(tmp_path, config, tiny_model_dir, reward_dir, monkeypatch):
    """PPO in bf16 (faked units): after an update, the rollouts come from the updated adapter, so two learning rates
    part after the first update. One autocast region around TRL's whole loop kept its cast of each trained weight
    from the first forward (autocast caches casts until its outermost region exits): every rollout, update and
    logged value used the untrained adapter, at any learning rate, and only the fp32 value head learned."""
    import torch

    from test_trainers import PER_TRAINER, prepare

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    logged = {}
    for lr in (1e-6, 1e-2):
        (tmp_path / str(lr)).mkdir()
        job = prepare(tmp_path / str(lr), copy.deepcopy(config), tiny_model_dir, "ppo",
                      args={**PER_TRAINER["ppo"], "per_device_train_batch_size": 4, "total_episodes": 12,
                            "learning_rate": lr, "logging_steps": 1})
        job["run"]["model_entry"] = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
        train_run(**job, reward_dir=reward_dir)
        state = json.loads((job["out_dir"] / "trainer_state.json").read_text())
        assert json.loads((job["out_dir"] / "manifest.json").read_text())["trl_args"]["bf16"] is True
        logged[lr] = [entry["objective/kl"] for entry in state["log_history"] if "objective/kl" in entry]
    slow, fast = logged.values()
    assert len(slow) == len(fast) == 3 and slow[0] == fast[0]  # the same first rollouts, before any update
    assert abs(fast[2] - slow[2]) > 0.01, logged


def test_missing_lora_target_lists_the_model_modules(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"models.qwen2-tiny.lora.target_modules: \['query_key_value'\] not in "
                                          r"the model \(Qwen2ForCausalLM\); its weight modules are .*'q_proj'"):
        check_lora_targets(model, ["query_key_value"], "qwen2-tiny")
    check_lora_targets(model, ["q_proj", "v_proj"], "qwen2-tiny")


@pytest.fixture
def sft_inputs(tmp_path, config, tiny_model_dir):
    rows = preprocess(read_jsonl(ROOT / "data/samples/tldr.jsonl")[:48], dataset="tldr", trainer="sft",
                      layout="language_modeling", columns={}, split="train").rows
    write_jsonl(rows[:40], tmp_path / "train.jsonl")
    write_jsonl(rows[40:], tmp_path / "eval.jsonl")
    (tmp_path / "lengths.json").write_text(json.dumps({"max_length": 64}))
    config["training"].update({"max_steps": 6, "save_steps": 3, "logging_steps": 1, "eval_steps": 3})
    runs = resolve_runs(config)
    return {"run": runs["sft-qwen2-tiny"], "model_dir": tiny_model_dir, "train_file": tmp_path / "train.jsonl", "eval_file": tmp_path / "eval.jsonl",
            "lengths_file": tmp_path / "lengths.json"}


def _losses(out_dir):
    state = json.loads((out_dir / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


def test_same_seed_gives_identical_losses_and_full_outputs(sft_inputs, tmp_path):
    a = train_run(**sft_inputs, out_dir=tmp_path / "a", checkpoint_dir=tmp_path / "ca")
    b = train_run(**sft_inputs, out_dir=tmp_path / "b", checkpoint_dir=tmp_path / "cb")
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    assert len(_losses(tmp_path / "a")) == 6
    assert a["eval_loss"] == b["eval_loss"]
    state = json.loads((tmp_path / "a" / "trainer_state.json").read_text())
    assert "train_runtime" in state["log_history"][-2] or "train_runtime" in state["log_history"][-1]
    assert (tmp_path / "a" / "adapter" / "adapter_model.safetensors").is_file()
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["versions"]["trl"] == "1.12.0"
    assert manifest["trl_args"]["max_length"] == 64 and manifest["config"] == sft_inputs["run"]
    assert set(manifest["inputs"]) == {"model", "train", "eval", "lengths"}
    assert manifest["inputs"]["train"]["path"] == str(sft_inputs["train_file"])
    assert all(len(entry["sha256"]) == 64 for entry in manifest["inputs"].values())
    assert manifest["snaketrl_version"] == snaketrl.__version__
    # Every field written is explained in docs/outputs.md (the glossary a user reads them with).
    glossary = (ROOT / "docs" / "outputs.md").read_text()
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    undocumented = [k for k in [*metrics, *manifest] if f"`{k}`" not in glossary
                    and not (k.startswith("eval_") and "`eval_*`" in glossary)]
    assert undocumented == []
    # The plan, as metrics.json reports it, with the reasons the log gave
    plan = {k: v for k, v in manifest["plan"].items() if k != "notes"}
    assert plan == {k: metrics[k] for k in plan} and plan["device"] == "cpu" and manifest["plan"]["notes"]
    import torch

    # What decides the rounding, so that two runs differing only there are explained (issue 24)
    assert manifest["numerics"] == {"device": manifest_cpu_model(), "dtype": "float32", "threads": torch.get_num_threads(),
                                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                    "dnnl_max_cpu_isa": os.environ.get("DNNL_MAX_CPU_ISA")}


def test_interrupted_run_resumes_from_last_checkpoint(sft_inputs, tmp_path):
    _interrupt_at_step_4(sft_inputs, tmp_path)
    assert not (tmp_path / "out" / "trainer_state.json").exists()

    train_run(**sft_inputs, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["resumed_from"].endswith("checkpoint-3")
    assert json.loads((tmp_path / "out" / "trainer_state.json").read_text())["global_step"] == 6


def _interrupt_at_step_4(inputs, tmp_path):
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise KeyboardInterrupt("simulated preemption")

    with pytest.raises(KeyboardInterrupt):
        train_run(**inputs, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", callbacks=[Crash()])
    assert (tmp_path / "ckpt" / "checkpoint-3").is_dir()


@pytest.mark.parametrize("change", ["config", "train", "lengths", "model", "code"])
def test_checkpoint_of_other_config_or_inputs_is_not_resumed(change, sft_inputs, tmp_path, caplog, monkeypatch):
    _interrupt_at_step_4(sft_inputs, tmp_path)
    if change == "code":  # snaketrl's source or a package version changed between the attempts
        from snaketrl import manifest

        monkeypatch.setattr("snaketrl.train.run.code_hash", lambda: manifest.code_hash() + "-edited")
    elif change == "config":
        sft_inputs["run"] = {**sft_inputs["run"], "args": {**sft_inputs["run"]["args"], "learning_rate": 1e-3}}
    elif change == "model":
        import shutil

        shutil.copytree(sft_inputs["model_dir"], tmp_path / "model2")
        with open(tmp_path / "model2" / "config.json", "a") as f:
            f.write("\n")  # same model, other bytes: the content hash decides
        sft_inputs["model_dir"] = tmp_path / "model2"
    else:
        path = sft_inputs[f"{change}_file"]
        path.write_text(path.read_text() + ("\n" if change == "lengths" else path.read_text().splitlines()[0] + "\n"))
    with caplog.at_level("WARNING", logger="snaketrl.train"):
        train_run(**sft_inputs, out_dir=tmp_path / "out2", checkpoint_dir=tmp_path / "ckpt")
    assert json.loads((tmp_path / "out2" / "manifest.json").read_text())["resumed_from"] is None
    assert f"were made with another {change}: starting over" in caplog.text


def test_sft_loss_falls_on_learnable_toy(sft_inputs, tmp_path):
    sft_inputs["run"]["args"].update({"max_steps": 20, "logging_steps": 5})
    sft_inputs["run"]["seed"] = learning.seed(sft_inputs["run"]["seed"])
    metrics = train_run(**sft_inputs, out_dir=tmp_path / "o", checkpoint_dir=tmp_path / "c")
    state = json.loads((tmp_path / "o" / "trainer_state.json").read_text())
    learning.check("sft toy", learning.UNIT["test_sft_loss_falls_on_learnable_toy"], state, metrics,
                   sft_inputs["run"]["seed"])


def test_max_tokens_bounds_the_steps_and_stops_where_the_tokens_reach_it(sft_inputs, tmp_path):
    """max_tokens 1000 over 8 examples a step of 20.5 tokens each (the length stage's mean_tokens): at most 7 steps,
    which train the tokens asked for, give or take the last step; a histogram without mean_tokens is refused.
    Examples longer than the histogram says (mean_tokens 5: at most 25 steps) reach the budget in fewer steps:
    the run stops at the first step by which it trained max_tokens real tokens."""
    from snaketrl.errors import TrainingError

    lengths = sft_inputs["lengths_file"]
    lengths.write_text(json.dumps({"max_length": 64}))
    run = {**sft_inputs["run"], "max_tokens": 1000, "args": {k: v for k, v in sft_inputs["run"]["args"].items()
                                                            if k not in ("max_steps", "eval_steps", "save_steps")}}
    with pytest.raises(TrainingError, match=r"lengths.json: no mean_tokens \(written by an older snaketrl\), which "
                                            r"max_tokens needs; rerun the histogram: snakemake --forcerun "
                                            r"length_histogram$"):
        train_run(**{**sft_inputs, "run": run}, out_dir=tmp_path / "x", checkpoint_dir=tmp_path / "cx")
    lengths.write_text(json.dumps({"max_length": 64, "mean_tokens": 20.5}))
    metrics = train_run(**{**sft_inputs, "run": run}, out_dir=tmp_path / "o", checkpoint_dir=tmp_path / "c")
    assert (metrics["max_tokens"], metrics["max_steps"]) == (1000, 7)  # ceil(1000 / (8 x 20.5))
    assert json.loads((tmp_path / "o" / "trainer_state.json").read_text())["global_step"] == metrics["steps"] <= 7
    assert metrics["real_tokens"] >= 1000 or metrics["steps"] == 7
    assert 7 * 8 * 10 < metrics["real_tokens"] < 1000 + 8 * 64

    lengths.write_text(json.dumps({"max_length": 64, "mean_tokens": 5}))
    metrics = train_run(**{**sft_inputs, "run": run}, out_dir=tmp_path / "o2", checkpoint_dir=tmp_path / "c2")
    assert metrics["max_steps"] == 25 and metrics["steps"] < 25
    assert 1000 <= metrics["real_tokens"] < 1000 + 8 * 64  # one step of 8 examples of at most 64 tokens over


def test_a_max_tokens_run_killed_after_its_last_step_resumes_to_the_same_run(sft_inputs, tmp_path):
    """Checkpoints at every step; the run stops on its budget and is killed before its outputs exist. The rerun
    resumes and stops at the same step with the same losses and tokens: no checkpoint of the stopping step was
    left to resume from (transformers would train one more step after it)."""
    from transformers import TrainerCallback

    class KillAtEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            raise KeyboardInterrupt("simulated preemption")

    sft_inputs["lengths_file"].write_text(json.dumps({"max_length": 64, "mean_tokens": 5}))
    args = {k: v for k, v in sft_inputs["run"]["args"].items() if k not in ("max_steps", "eval_steps")}
    run = {**sft_inputs["run"], "max_tokens": 1000, "args": {**args, "save_steps": 1, "save_total_limit": 2}}
    whole = train_run(**{**sft_inputs, "run": run}, out_dir=tmp_path / "a", checkpoint_dir=tmp_path / "ca")
    with pytest.raises(KeyboardInterrupt):
        train_run(**{**sft_inputs, "run": run}, out_dir=tmp_path / "b", checkpoint_dir=tmp_path / "cb",
                  callbacks=[KillAtEnd()])
    assert not (tmp_path / "b" / "metrics.json").exists()
    assert not (tmp_path / "cb" / f"checkpoint-{whole['steps']}").exists()
    resumed = train_run(**{**sft_inputs, "run": run}, out_dir=tmp_path / "b", checkpoint_dir=tmp_path / "cb")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["resumed_from"] is not None
    assert (resumed["steps"], resumed["real_tokens"]) == (whole["steps"], whole["real_tokens"])
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")


def test_a_run_that_makes_no_optimizer_step_fails_and_writes_nothing(sft_inputs, tmp_path):
    from snaketrl.errors import TrainingError

    # Not from a checked config (the parse refuses these): whatever leads to zero steps is caught in the job.
    sft_inputs["run"]["args"].update({"num_train_epochs": -1, "max_steps": -1})
    with pytest.raises(TrainingError, match=r"^run 'sft-qwen2-tiny': training ended after 0 optimizer steps \(40 "
                                            r"training examples; per_device_train_batch_size 8, "
                                            r"gradient_accumulation_steps 1, num_train_epochs -1, max_steps -1\); "
                                            r"nothing was written$"):
        train_run(**sft_inputs, out_dir=tmp_path / "o", checkpoint_dir=tmp_path / "c")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("items", [None, 7])
def test_the_one_pass_loss_is_trls_chunked_loss(items):
    """snaketrl.train.labelled.one_pass_loss against TRL's chunked_nll loss (chunks of 4, recomputed): the same loss,
    correct tokens, entropy and label tokens, and the same gradients, with prompt and padding labels (-100)."""
    import torch

    from snaketrl.train.labelled import one_pass_loss, trl_loss

    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 9, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (2, 9))
    labels[0, :3], labels[1, 6:] = -100, -100
    results = []
    for fn, chunk in ((trl_loss(), 4), (one_pass_loss, None)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, correct, entropy, count = fn(h, w, chunk, labels=labels, num_items_in_batch=items)
        loss.backward()
        results.append((loss, correct, entropy, count, h.grad, w.grad))
    assert results[1][3].item() == results[0][3].item() == 11  # shifted: 2 x 8 targets, 2 + 3 of them -100
    for ours, trls in zip(results[1], results[0]):
        torch.testing.assert_close(ours.float(), trls.float(), rtol=1e-5, atol=1e-6)


def test_sft_on_a_cpu_takes_its_loss_on_label_tokens_only_to_the_same_losses(tmp_path, config, tiny_model_dir):
    """The train job's choice: SFT of a real model on a CPU computes logits only at label tokens
    (logits_on_labels_only), to TRL's own loss: the same logged losses as the run that sets loss_type nll. A tiny
    model, GPU runs and other trainers keep TRL's loss path (a tiny model's thresholds were measured on it)."""
    from transformers import AutoModelForCausalLM

    from snaketrl.train.labelled import choose
    from test_trainers import prepare

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert [choose(*case, model, {})[0] for case in (("sft", {}, "cpu"), ("sft", {}, "cuda"), ("dpo", {}, "cuda"),
                                                     ("reward", {}, "cpu"))] \
        == [True, False, False, False] and choose("sft", {}, "cpu", model, {}, tiny=True) == (False, None)
    losses = {}
    for name, extra in (("one-pass", {}), ("nll", {"loss_type": "nll"})):
        (tmp_path / name).mkdir()
        job = prepare(tmp_path / name, copy.deepcopy(config), tiny_model_dir, "sft")
        job["run"]["args"].update(extra)
        # the tiny model's files, as a real model's entry names them
        job["run"]["model_entry"] = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
        job["run"]["args"]["bf16"] = False  # fp32: on a CPU with bf16 units bf16's rounding would swamp the check
        metrics = train_run(**job)
        assert metrics["logits_on_labels_only"] is (name == "one-pass")
        state = json.loads((job["out_dir"] / "trainer_state.json").read_text())
        losses[name] = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses["nll"]) == 3 and losses["one-pass"] == pytest.approx(losses["nll"], rel=1e-5)


@pytest.mark.parametrize("row_groups", [False, True])
def test_dpo_on_a_cpu_projects_completions_only_to_the_same_losses(tmp_path, config, tiny_model_dir, row_groups):
    """DPO of a real model on a CPU projects the policy's and the reference's hidden states onto the vocabulary,
    and runs TRL's loss, only from each row's first completion token on (snaketrl.train.labelled.completion_logits):
    the same logged losses, rewards, entropy, logits and token accuracy, and eval loss, as TRL's logits at every
    position (the run of the same model as a tiny one, which keeps them), for fewer FLOPs."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    from snaketrl.train.labelled import choose
    from test_trainers import prepare

    class Projection(TrainerCallback):
        """Each forward's width and the projected positions' (rows, width, hidden) after it."""
        def __init__(self):
            self.widths, self.projected = [], []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.get_input_embeddings().register_forward_pre_hook(
                lambda module, inputs: self.widths.append(inputs[0].shape[1]))
            model.get_output_embeddings().register_forward_pre_hook(
                lambda module, inputs: self.projected.append((inputs[0].shape, inputs[0].is_contiguous())))

    assert choose("dpo", {}, "cpu", AutoModelForCausalLM.from_pretrained(tiny_model_dir), {})[0]
    logs, metrics = {}, {}
    for name in ("completions", "tiny"):
        (tmp_path / name).mkdir()
        job = prepare(tmp_path / name, copy.deepcopy(config), tiny_model_dir, "dpo")
        if row_groups:  # the length stage's CPU choice: length-grouped batches, each in two row groups
            job["lengths_file"].write_text(json.dumps({"max_length": 64, "batching_by_device": {"cpu": {
                "strategy": "grouped", "split_rows": True, "args": {"train_sampling_strategy": "group_by_length",
                "remove_unused_columns": False, "length_column_name": "snaketrl_length"}}}}))
        if name == "completions":  # the tiny model's files, as a real model's entry names them
            job["run"]["model_entry"] = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
            job["run"]["args"]["bf16"] = False  # fp32, as the tiny run: on a CPU with bf16 units it would take bf16
        projection = Projection()
        metrics[name] = train_run(**job, callbacks=[projection])
        assert len(projection.widths) == len(projection.projected) > 6
        assert all(contiguous for _, contiguous in projection.projected)
        shorter = [shape[1] < width for width, (shape, _) in zip(projection.widths, projection.projected)]
        assert all(shorter) if name == "completions" else not any(shorter)
        assert metrics[name]["logits_on_labels_only"] is (name == "completions")
        assert metrics[name]["row_groups"] is row_groups
        state = json.loads((job["out_dir"] / "trainer_state.json").read_text())
        logs[name] = [{k: v for k, v in h.items() if k in ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies",
                                                            "entropy", "logits/chosen", "logits/rejected",
                                                            "mean_token_accuracy", "num_tokens")}
                      for h in state["log_history"] if "loss" in h]
    assert len(logs["tiny"]) == 3 and all(len(h) == 9 for h in logs["tiny"])
    for ours, trls in zip(logs["completions"], logs["tiny"], strict=True):
        assert ours == pytest.approx(trls, rel=1e-4, abs=1e-6)
    assert metrics["completions"]["eval_loss"] == pytest.approx(metrics["tiny"]["eval_loss"], rel=1e-5)
    assert metrics["completions"]["flops"] < 0.97 * metrics["tiny"]["flops"]
