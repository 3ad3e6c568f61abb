"""Generation with the LoRA adapter merged or its decode compiled (snaketrl.train.generation): the tokens of TRL's
eager unmerged generation, the exact base weights back for the trained pass, the same GRPO losses, and the plan's
rules."""

import contextlib
import dataclasses

import learning
import pytest
from unittest import mock

from conftest import ROOT
from snaketrl.io import read_jsonl
from test_plan import GIB, plan_of
from test_trainers import PER_TRAINER, prepare


def lora_model(tiny_model_dir):
    """The tiny model with a trained-looking adapter (B non-zero: the init's zero B makes merging a no-op), in
    training mode as TRL samples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    return model.train(), tokenizer


def prompts(tokenizer, n=8):
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:n]
    return tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)


def generate(model, tokenizer, inputs, **kwargs):
    from transformers import set_seed

    set_seed(0)
    out = model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, pad_token_id=tokenizer.pad_token_id,
                         **kwargs)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def base_weights(model) -> dict:
    from peft.tuners.lora import LoraLayer

    return {name: m.get_base_layer().weight.detach().clone() for name, m in model.named_modules()
            if isinstance(m, LoraLayer)}


def test_merged_generation_gives_the_unmerged_tokens(tiny_model_dir):
    """Greedy: the same tokens. Sampling with the same seed: the same tokens (measured here: all 8 rows x 24)."""
    from snaketrl.train.generation import merged

    model, tokenizer = lora_model(tiny_model_dir)
    inputs = prompts(tokenizer)
    for sampling in ({"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}):
        unmerged = generate(model, tokenizer, inputs, **sampling)
        with merged(model):
            assert all(layer.merged for layer in lora_layers(model))
            tokens = generate(model, tokenizer, inputs, **sampling)
        assert tokens == unmerged, sampling
        with model.disable_adapter():  # the adapter changes what is generated: the comparison above is not moot
            assert generate(model, tokenizer, inputs, **sampling) != unmerged, sampling


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def test_the_base_weights_come_back_bit_for_bit_after_every_generation(tiny_model_dir):
    """Generate merged, train a step, three times over: the base weights are those before, bit for bit, and the
    trained pass runs the adapter (the forward's logits and the adapter's gradients of an unmerged model)."""
    import torch

    from snaketrl.train.generation import merged

    model, tokenizer = lora_model(tiny_model_dir)
    inputs = prompts(tokenizer)
    before = base_weights(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        expected = model(**inputs).logits
        with merged(model):
            merged_weights = base_weights(model)
            generate(model, tokenizer, inputs, do_sample=True, temperature=0.7)
        assert not any(layer.merged for layer in lora_layers(model))
        after = base_weights(model)
        assert all(torch.equal(after[name], weight) for name, weight in before.items())
        assert not any(torch.equal(merged_weights[name], weight) for name, weight in before.items())
        logits = model(**inputs).logits
        assert torch.equal(logits, expected)
        optimizer.zero_grad()
        logits.float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)
        optimizer.step()


def test_an_interrupted_generation_restores_the_base_weights(tiny_model_dir):
    import torch

    from snaketrl.train.generation import merged

    model, _ = lora_model(tiny_model_dir)
    before = base_weights(model)
    with pytest.raises(KeyboardInterrupt), merged(model):
        raise KeyboardInterrupt
    assert not any(layer.merged for layer in lora_layers(model))
    assert all(torch.equal(base_weights(model)[name], weight) for name, weight in before.items())


# Generation batches in 2 steps and the evaluation of 4 eval rows: GRPO's and RLOO's a step and 2 evaluation batches,
# online DPO's a step (it has no evaluation). The first step's adapter is LoRA's init (B zero), the rest trained.
GENERATIONS = {"grpo": 2 + 2, "rloo": 2 + 2, "online_dpo": 2}
LOGGED = {"grpo": ("loss", "reward", "rewards/unique_chars/mean"), "rloo": ("loss", "reward"),
          "online_dpo": ("loss", "objective/scores")}


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "online_dpo"])
def test_online_trainers_train_with_merged_generation_as_on_trls_path(tmp_path, config, tiny_model_dir, monkeypatch,
                                                                      trainer):
    """Two steps through train_run, TRL's generation against the merged one (forced on: the plan keeps a tiny
    model on TRL's path): every generation merged, the same losses and rewards, and the same adapter."""
    import json

    import torch
    from safetensors.torch import load_file

    import snaketrl.train.generation as generation
    import snaketrl.train.run as run_module
    from snaketrl.train.run import train_run

    entries, outs, metrics = [], {}, {}
    for merge in (False, True):
        (tmp_path / str(merge)).mkdir()
        inputs = prepare(tmp_path / str(merge), config, tiny_model_dir, trainer,
                         args={**PER_TRAINER.get(trainer, {}), "max_steps": 2})
        if merge:
            plan_run, merged = run_module.plan_run, generation.merged
            monkeypatch.setattr(run_module, "plan_run", lambda *a, **k: dataclasses.replace(
                plan_run(*a, **k), merged_generation=True))
            monkeypatch.setattr(generation, "merged", lambda model: entries.append(model) or merged(model))
        metrics[merge], outs[merge] = train_run(**inputs), inputs["out_dir"]
    assert len(entries) == GENERATIONS[trainer]
    evaluated = sorted(key for key in metrics[False] if key.startswith("eval_") and "runtime" not in key
                       and "per_second" not in key)
    assert [metrics[True][k] for k in evaluated] == pytest.approx([metrics[False][k] for k in evaluated], rel=1e-5,
                                                                  abs=1e-6)
    assert "merged_generation" not in metrics[False] and metrics[True]["merged_generation"] is True
    states = {merge: json.loads((out / "trainer_state.json").read_text()) for merge, out in outs.items()}
    for key in LOGGED[trainer]:
        plain = learning.logged(states[False], key)
        assert len(plain) == 2 and learning.logged(states[True], key) == pytest.approx(plain, rel=1e-5, abs=1e-6), key
    adapters = [load_file(out / "adapter" / "adapter_model.safetensors") for out in outs.values()]
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.allclose(adapters[0][k], adapters[1][k], rtol=0, atol=1e-6) for k in adapters[0])


def cpu(gib=64):
    from snaketrl.train.plan import Device

    return Device("cpu", False, gib * GIB)


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "online_dpo"])
def test_the_plan_merges_an_online_trainers_generation_on_a_cpu_for_a_real_model(tmp_path, config, tiny_model_dir,
                                                                                 trainer):
    job, tiny = plan_of(tmp_path / "tiny", config, tiny_model_dir, trainer, cpu())
    real = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}  # a real model's entry
    _, plan = plan_of(tmp_path / "real", config, tiny_model_dir, trainer, cpu(), run={"model_entry": real})
    assert plan.merged_generation is True and plan.report()["merged_generation"] is True
    assert any(note.startswith("generation with the LoRA adapter merged: ") for note in plan.notes)
    assert tiny.merged_generation is False and "merged_generation" not in tiny.report()


@pytest.mark.parametrize("change", [{"lora": {"lora_dropout": 0.05}}, {"lora": {"use_dora": True}},
                                    {"model_entry": {"quantization": "4bit"}}, {"trainer": "ppo"},
                                    {"trainer": "sft"}, {"args": {"bf16": True}}, {"args": {"fp16": True}},
                                    {"args": {"use_vllm": True}}])
def test_the_plan_keeps_trls_generation_where_merged_would_differ(change):
    from types import SimpleNamespace

    from snaketrl.train.plan import merges_for_generation

    run = {"trainer": "grpo", "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}, "model_entry": {"gguf": {}},
           "args": {"bf16": False, "fp16": False, "use_vllm": False}}
    assert merges_for_generation(run, "cpu", SimpleNamespace(**run["args"]), sharded=False)[0] is True
    changed = {**run, **{k: ({**run[k], **v} if isinstance(v, dict) else v) for k, v in change.items()}}
    assert merges_for_generation(changed, "cpu", SimpleNamespace(**changed["args"]), sharded=False)[0] is False


def test_the_plan_keeps_trls_generation_on_a_gpu_and_for_sharded_weights():
    from types import SimpleNamespace

    from snaketrl.train.plan import merges_for_generation

    run = {"trainer": "rloo", "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}, "model_entry": {"gguf": {}}}
    args = SimpleNamespace(bf16=False, fp16=False, use_vllm=False)
    assert merges_for_generation(run, "cpu", args, sharded=False)[0] is True
    assert merges_for_generation(run, "cpu", args, sharded=True)[0] is False
    assert merges_for_generation(run, "cuda", args, sharded=False)[0] is False  # not measured on a GPU


def cuda(gib=80):
    """A GPU without bf16 units: TRL's config refuses bf16 on a machine without a GPU, this one."""
    from snaketrl.train.plan import Device

    return Device("cuda", False, gib * GIB)


# The length stage's file of a run whose longest prompt has 150 tokens.
LENGTHS = {"max_length": 128, "percentiles": {"p100": 150}, "n_examples": 20}


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_the_plan_compiles_the_decode_on_a_gpu_for_a_real_model(tmp_path, config, tiny_model_dir, trainer):
    """On CUDA, 8 steps of a real model's GRPO or RLOO: a static cache of the longest prompt plus the completion cap
    (150 + 8, in 64s: 192), in the report and the notes; on a CPU, or for a tiny model, the eager decode."""
    args = {**PER_TRAINER[trainer], "max_steps": 8}
    job, tiny = plan_of(tmp_path / "tiny", config, tiny_model_dir, trainer, cuda(), lengths=LENGTHS, args=args)
    real = {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}
    _, plan = plan_of(tmp_path / "real", config, tiny_model_dir, trainer, cuda(), lengths=LENGTHS, args=args,
                      run={"model_entry": real})
    assert plan.compiled_decode == 192 and plan.report()["compiled_decode"] == {"max_cache_len": 192}
    assert [n for n in plan.notes if n.startswith("decode compiled on a static cache of 192 positions: 8 generation "
                                                  "rounds pay its compile back (~8 steps do): on an H200")]
    _, on_cpu = plan_of(tmp_path / "cpu", config, tiny_model_dir, trainer, cpu(), lengths=LENGTHS, args=args,
                        run={"model_entry": real})
    for eager in (tiny, on_cpu):
        assert eager.compiled_decode == 0 and "compiled_decode" not in eager.report()
        assert not any(note.startswith("decode ") for note in eager.notes)
    _, few = plan_of(tmp_path / "few", config, tiny_model_dir, trainer, cuda(), lengths=LENGTHS,
                     args={**args, "max_steps": 7}, run={"model_entry": real})
    assert few.compiled_decode == 0
    assert [n for n in few.notes if n.startswith("decode eager: 7 generation rounds are too few to pay a compile "
                                                 "back (~8 steps do): on an H200")]


def test_the_plan_compiles_ppos_decode_on_a_gpu_from_its_updates(tmp_path, config, tiny_model_dir):
    """PPO's generation rounds are its updates (TRL's num_total_batches: total_episodes over the rollout batch, or
    its epochs over the prompts): 8 updates of a real model on CUDA compile the policy's decode on a static cache of
    the longest prompt plus response_length (150 + 8, in 64s: 192); 7 do not pay it back."""
    from types import SimpleNamespace

    from snaketrl.train.plan import planned_generations

    args = {**PER_TRAINER["ppo"], "per_device_train_batch_size": 4, "total_episodes": 32}
    job, tiny = plan_of(tmp_path / "tiny", config, tiny_model_dir, "ppo", cuda(), lengths=LENGTHS, args=args)
    assert tiny.compiled_decode == 0
    real = {"model_entry": {k: v for k, v in job["run"]["model_entry"].items() if k != "tiny"}}
    _, plan = plan_of(tmp_path / "real", config, tiny_model_dir, "ppo", cuda(), lengths=LENGTHS, args=args, run=real)
    assert plan.compiled_decode == 192 and plan.report()["compiled_decode"] == {"max_cache_len": 192}
    assert [n for n in plan.notes if n.startswith("decode compiled on a static cache of 192 positions: 8 generation "
                                                  "rounds pay its compile back (~8 steps do): on an H200, PPO")]
    _, few = plan_of(tmp_path / "few", config, tiny_model_dir, "ppo", cuda(), lengths=LENGTHS,
                     args={**args, "total_episodes": 28}, run=real)
    assert few.compiled_decode == 0 and [n for n in few.notes if n.startswith("decode eager: 7 generation rounds")]
    epochs = SimpleNamespace(**{**vars(few.args), "total_episodes": None, "num_train_epochs": 3})
    assert planned_generations(epochs, {"n_examples": 20}, world=2) == 8  # 60 episodes, 8 a rollout
    assert planned_generations(epochs, {}) is None


@pytest.mark.parametrize("change", [{"device": "cpu"}, {"trainer": "online_dpo"},
                                    {"trainer": "sft"}, {"model_entry": {"quantization": "4bit"}},
                                    {"model_entry": {"tiny": {}}}, {"lora": {"lora_dropout": 0.05}},
                                    {"sharded": True}, {"use_vllm": True},
                                    {"use_transformers_continuous_batching": True}, {"generations": 7},
                                    {"generations": None}])
def test_the_plan_keeps_the_eager_decode_where_a_compile_is_unmeasured_or_does_not_pay(change):
    from types import SimpleNamespace

    from snaketrl.train.plan import compiles_decode

    facts = {"trainer": "grpo", "model_entry": {"gguf": {}}, "lora": {"r": 16, "lora_dropout": 0.0}, "device": "cuda",
             "sharded": False, "use_vllm": False, "use_transformers_continuous_batching": False, "generations": 8}

    def compiles(facts):
        args = SimpleNamespace(use_vllm=facts["use_vllm"],
                               use_transformers_continuous_batching=facts["use_transformers_continuous_batching"])
        run = {key: facts[key] for key in ("trainer", "model_entry", "lora")}
        return compiles_decode(run, facts["device"], args, facts["sharded"], facts["generations"])

    assert compiles(facts)[0] is True
    on, why = compiles({**facts, **change})
    assert on is False
    assert why.startswith(("7 generation rounds are too few", "the run's generation rounds are not known")) \
        if "generations" in change else why == ""


def test_the_planned_generation_rounds_are_trls(tmp_path, tiny_model_dir):
    """From max_steps (a generation every steps_per_generation x num_iterations micro-batches), and from the epochs
    over the length stage's prompts: the rounds of a built GRPO trainer's dataloader."""
    from types import SimpleNamespace

    from snaketrl.train.plan import planned_generations

    args = SimpleNamespace(max_steps=10, gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2)
    assert planned_generations(args, {}) == 5
    trainer, _, _ = grpo_trainer(tmp_path, tiny_model_dir)  # 4 prompts, 2 completions each, 4 completions a round
    args = SimpleNamespace(**{**vars(trainer.args), "max_steps": -1, "num_train_epochs": 3})
    # the dataloader repeats each round's batch steps_per_generation x num_iterations times
    rounds = 3 * len(trainer.get_train_dataloader()) // (args.steps_per_generation * args.num_iterations)
    assert planned_generations(args, {"n_examples": 4}) == rounds == 6
    assert planned_generations(args, {}) is None


def grpo_trainer(tmp_path, tiny_model_dir):
    """A built GRPO trainer on the tiny model, TRL's generation (sampling, 16 new tokens at most), with the
    workflow's token and FLOP hooks installed as a train job installs them."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from snaketrl.train.tokens import TokenCounter

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:4]
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=16, temperature=0.7, report_to="none", use_cpu=True)
    counter = TokenCounter(tokenizer.pad_token_id)
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, reward_funcs=lambda completions, **_:
                          [0.0] * len(completions), train_dataset=Dataset.from_list([{"prompt": r["prompt"]}
                                                                                     for r in rows]),
                          peft_config=LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32,
                                                 target_modules=["q_proj", "k_proj", "v_proj"]),
                          callbacks=[counter])
    counter.watch(trainer)
    counter.on_train_begin(args, trainer.state, trainer.control, model=trainer.model)
    return trainer, counter, [tokenizer(r["prompt"])["input_ids"][-40:] for r in rows]


def test_compiled_decode_gives_trls_tokens_without_a_graph_break_and_counts_the_same_flops(tmp_path, tiny_model_dir):
    """compile_decode on a CPU (transformers' `_compile_all_devices`): TRL's sampled completions under the same seed,
    token for token (compared exactly); the decode step one graph with snaketrl's token and FLOP hooks installed
    (traced into it, the FLOP hook broke it on the cache's length, a tensor: on the H200, CUDA graphs of the
    pieces overwrote each other's outputs); the generation's FLOPs those of the eager generation (the compiled
    steps counted outside the graph). Compiled by dynamo and AOT autograd (the static cache's in-place writes
    functionalized) and run without inductor's code generation, whose C++ kernels take minutes on a busy
    2-core machine: with inductor the tokens were measured equal too (8 rows of 24, two adapters, bench/rl.py)."""
    from torch._dynamo.utils import counters
    from transformers import set_seed

    from snaketrl.train.generation import compile_decode

    trainer, counter, prompt_ids = grpo_trainer(tmp_path, tiny_model_dir)

    def generate():
        set_seed(0)
        completions, _ = trainer._generate_single_turn(prompt_ids, None, {})
        return completions, counter.flops.take()

    eager, eager_flops = generate()
    assert trainer.generation_config.disable_compile and trainer.generation_config.cache_implementation is None
    assert max(len(c) for c in eager) == 16 and eager_flops["forward_only_tokens"] > 4 * 16
    compile_decode(trainer, 64, "cpu")
    trainer.generation_config.compile_config.backend = "aot_eager"
    fresh_compile()
    compiled, compiled_flops = generate()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the decode step, compiled once
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled == eager
    assert compiled_flops == eager_flops
    again, again_flops = generate()  # the compiled step again: no recompile, the same count
    assert again == eager and again_flops == eager_flops and counters["stats"]["unique_graphs"] == 1


def compiled_train_run(tmp_path, config, tiny_model_dir, monkeypatch, args, real=False, trainer_name="grpo",
                       reward_dir=None):
    """train_run of a GRPO run, or another `trainer_name`'s (PPO's with its `reward_dir`; `real`: its model entry
    without `tiny`, as a real model's) with its plan's decode;
    the trainers compile_decode built recorded (with dynamo's aot_eager backend off CUDA: inductor's C++ kernels
    take minutes on a busy 2-core machine)."""
    import snaketrl.train.run as run_module
    from snaketrl.train.run import train_run

    compiled = []
    compile_decode = run_module.compile_decode

    def recorded(trainer, max_cache_len, device):
        compile_decode(trainer, max_cache_len, device)
        if device != "cuda":
            generation_config(trainer).compile_config.backend = "aot_eager"
        compiled.append(trainer)

    monkeypatch.setattr(run_module, "compile_decode", recorded)
    inputs = prepare(tmp_path, config, tiny_model_dir, trainer_name, args=args)
    if reward_dir:
        inputs["reward_dir"] = reward_dir
    if real:
        inputs["run"]["model_entry"] = {k: v for k, v in inputs["run"]["model_entry"].items() if k != "tiny"}
    return train_run(**inputs), inputs["out_dir"], compiled


def fresh_compile():
    """dynamo's counters from zero and its caches empty: a decode step another test in this process compiled (the
    same tiny model and cache) would be reused, not counted."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def generation_config(trainer):
    """The generation config a trainer's decode reads: GRPO's own, PPO's policy's (TRL's loop builds one per call
    over it)."""
    return trainer.policy_model.generation_config if hasattr(trainer, "policy_model") else trainer.generation_config


def test_a_planned_compiled_decode_trains_ppo_as_trls_eager_one(tmp_path, config, tiny_model_dir, monkeypatch):
    """Two PPO updates through train_run, TRL's eager decode against the compiled one (forced on a CPU): the policy's
    generation config on the plan's static cache, compiled without graph breaks; the same logged objective (the
    same completions and updates)."""
    import json

    from torch._dynamo.utils import counters

    import snaketrl.train.run as run_module

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)  # an untrained score head, the same for both runs: PPO's reward and value model
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm")
    args = {**PER_TRAINER["ppo"], "per_device_train_batch_size": 4, "total_episodes": 8}
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    eager, eager_out, none = compiled_train_run(tmp_path / "eager", config, tiny_model_dir, monkeypatch, args,
                                                trainer_name="ppo", reward_dir=tmp_path / "rm")
    assert none == [] and "compiled_decode" not in eager
    plan_run = run_module.plan_run
    monkeypatch.setattr(run_module, "plan_run", lambda *a, **k: dataclasses.replace(plan_run(*a, **k),
                                                                                  compiled_decode=64))
    fresh_compile()
    metrics, out, [trainer] = compiled_train_run(tmp_path / "compiled", config, tiny_model_dir, monkeypatch, args,
                                                 trainer_name="ppo", reward_dir=tmp_path / "rm")
    config_ = generation_config(trainer)
    assert (config_.cache_implementation, config_.max_cache_len, config_.disable_compile) == ("static", 64, False)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["stats"])
    assert metrics["compiled_decode"] == {"max_cache_len": 64}
    states = [json.loads((o / "trainer_state.json").read_text()) for o in (eager_out, out)]
    for key in ("objective/rlhf_reward", "objective/kl", "loss/policy_avg", "loss/value_avg"):
        plain = learning.logged(states[0], key)
        assert len(plain) == 2 and learning.logged(states[1], key) == pytest.approx(plain, rel=1e-4, abs=1e-6), key


def test_a_planned_compiled_decode_trains_as_trls_eager_one(tmp_path, config, tiny_model_dir, monkeypatch):
    """Two GRPO steps through train_run, TRL's eager decode against the compiled one (forced on a CPU: the plan
    compiles on CUDA only): the generation config the plan's static cache of 64 positions, compiled without graph
    breaks; the same losses and rewards (the same completions), the manifest's plan says so."""
    import json

    from torch._dynamo.utils import counters

    import snaketrl.train.run as run_module

    args = {**PER_TRAINER["grpo"], "max_steps": 2}
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    eager, eager_out, none = compiled_train_run(tmp_path / "eager", config, tiny_model_dir, monkeypatch, args)
    assert none == [] and "compiled_decode" not in eager
    plan_run = run_module.plan_run
    monkeypatch.setattr(run_module, "plan_run", lambda *a, **k: dataclasses.replace(plan_run(*a, **k),
                                                                                  compiled_decode=64))
    fresh_compile()
    metrics, out, compiled = compiled_train_run(tmp_path / "compiled", config, tiny_model_dir, monkeypatch, args)
    [trainer] = compiled
    config_ = trainer.generation_config
    assert (config_.cache_implementation, config_.max_cache_len, config_.disable_compile) == ("static", 64, False)
    assert config_.compile_config.fullgraph is True and config_.compile_config._compile_all_devices is True
    assert trainer.generation_kwargs["cache_implementation"] == "static"
    assert trainer.generation_kwargs["max_cache_len"] == 64
    # the decode step of the training batch (8 completions) and of the evaluation's (4)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["stats"])
    assert metrics["compiled_decode"] == {"max_cache_len": 64}
    plan = json.loads((out / "manifest.json").read_text())["plan"]
    assert plan["compiled_decode"] == {"max_cache_len": 64}
    states = [json.loads((o / "trainer_state.json").read_text()) for o in (eager_out, out)]
    for key in LOGGED["grpo"]:
        plain = learning.logged(states[0], key)
        assert len(plain) == 2 and learning.logged(states[1], key) == pytest.approx(plain, rel=1e-5, abs=1e-6), key
    assert metrics["flops"] == eager["flops"]  # compiled decode steps counted as eager ones


@pytest.mark.cuda
def test_a_grpo_job_on_a_gpu_compiles_its_decode_as_planned_and_trains(tmp_path, config, tiny_model_dir,
                                                                      monkeypatch):
    """On CUDA, 8 steps of a GRPO run whose model is not a tiny one (its entry without `tiny`): the plan compiles the
    decode (inductor, CUDA graphs) and the job trains its 8 steps with it, without a graph break."""
    import json

    from torch._dynamo.utils import counters

    fresh_compile()
    metrics, out, compiled = compiled_train_run(tmp_path, config, tiny_model_dir, monkeypatch,
                                                {**PER_TRAINER["grpo"], "max_steps": 8}, real=True)
    [trainer] = compiled
    assert metrics["compiled_decode"] == {"max_cache_len": trainer.generation_config.max_cache_len}
    assert trainer.generation_config.compile_config.backend == "inductor"
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["stats"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and len(learning.logged(state, "loss")) == 8
    assert metrics["flops"] > 0 and (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.cuda
def test_a_ppo_job_on_a_gpu_compiles_its_decode_as_planned_and_trains(tmp_path, config, tiny_model_dir, monkeypatch):
    """On CUDA, 8 updates of a PPO run whose model is not a tiny one: the plan compiles the policy's decode
    (inductor, CUDA graphs) and the job trains its 8 updates with it, without a graph break."""
    import json

    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm")
    fresh_compile()
    metrics, out, [trainer] = compiled_train_run(
        tmp_path, config, tiny_model_dir, monkeypatch,
        {**PER_TRAINER["ppo"], "per_device_train_batch_size": 4, "total_episodes": 32}, real=True,
        trainer_name="ppo", reward_dir=tmp_path / "rm")
    assert metrics["compiled_decode"] == {"max_cache_len": generation_config(trainer).max_cache_len}
    assert generation_config(trainer).compile_config.backend == "inductor"
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["stats"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and len(learning.logged(state, "objective/rlhf_reward")) == 8


def test_merged_generation_composes_with_a_compiled_decode(tiny_model_dir):
    """Merged generation swaps each adapted layer's weight tensor for a merged copy on every call; a compiled decode
    step reads the weights as inputs of its graph (not constants): merged and compiled, the tokens of the unmerged
    eager generation, for the adapter before and after it changes (the second call's merged copies are new)."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from snaketrl.train.generation import merged

    model, tokenizer = lora_model(tiny_model_dir)
    inputs = prompts(tokenizer, n=4)
    fresh_compile()
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True)
    compile_config._compile_all_devices = True
    compiled = {"cache_implementation": "static", "max_cache_len": 64, "compile_config": compile_config}
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
    before = None
    for _ in range(2):
        eager = generate(model, tokenizer, inputs, **sampling)
        with merged(model):
            assert generate(model, tokenizer, inputs, **sampling, **compiled) == eager
        assert eager != before  # the adapter's change changed the tokens: the second comparison is not the first's
        before = eager
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.2)
    assert counters["stats"]["unique_graphs"] == 1  # compiled once: new weight tensors are new inputs, no recompile


def test_ppos_generation_compiles_its_decode_from_the_policys_generation_config(tiny_model_dir):
    """TRL's PPO loop builds its GenerationConfig in `train` and generates through its module's batch_generation:
    with compile_policy_decode the policy's own config carries the static cache and the compile (transformers fills
    what PPO's config leaves unset from it). The same sampled tokens and logits as eager under the same seed, the
    decode step one graph without a break (aot_eager, as above); the eager call before it really eager."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import GenerationConfig, set_seed
    from trl.experimental.ppo.ppo_trainer import batch_generation

    from snaketrl.train.generation import compile_policy_decode

    model, tokenizer = lora_model(tiny_model_dir)
    queries = prompts(tokenizer, n=4)["input_ids"]
    # as PPOTrainer.train builds it (trl/experimental/ppo/ppo_trainer.py)
    config = GenerationConfig(max_new_tokens=16, temperature=0.7 + 1e-7, top_k=0.0, top_p=1.0, do_sample=True)

    def generate():
        set_seed(0)
        return batch_generation(model, queries, 2, tokenizer.pad_token_id, config)

    fresh_compile()
    eager, eager_logits = generate()
    assert counters["stats"]["unique_graphs"] == 0 and eager.shape[1] == queries.shape[1] + 16
    compile_policy_decode(model, 64, "cpu")
    model.generation_config.compile_config.backend = "aot_eager"
    compiled, logits = generate()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    assert torch.equal(compiled, eager)
    assert torch.allclose(logits, eager_logits, atol=1e-4)
    assert config.cache_implementation is None  # PPO's own config untouched: the model's filled the call's copy


@pytest.mark.parametrize("bf16_packed", [False, True])
def test_generation_with_trained_rows_merged_gives_the_same_tokens_without_a_weight_copy_a_step(tmp_path,
                                                                                               bf16_packed):
    """A chat template's added tokens train as rows of the tied embeddings and head (peft's trainable tokens), whose
    layers build the whole weight at every forward: two copies a decode step. Merged for the generation
    (merged(rows_only=True), outside generation's packed weights as run.py orders them), none within; the same
    tokens, greedy and sampled under a seed, prompts with the added tokens in them; afterwards the original weight
    tensor again, and the rows' forward as before."""
    import torch
    from test_logps import ADDED, trained_rows_model

    from snaketrl.train.generation import merged
    from snaketrl.train.packed import packed

    model = trained_rows_model(tmp_path).eval()
    if bf16_packed:
        model = model.to(torch.bfloat16)
    embeddings = model.get_input_embeddings()
    weight = embeddings.token_adapter.base_layer.weight
    original, storage = weight.detach().clone(), weight.data.data_ptr()
    ids = torch.tensor([[ADDED[0], 5, 6, 7, ADDED[1]], [ADDED[0], 9, 10, 11, ADDED[1]]])
    copies, index_copy = [], torch.Tensor.index_copy

    def counted(self, *args, **kwargs):
        copies.append(self.shape)
        return index_copy(self, *args, **kwargs)

    out = {}
    for rows_merged in (False, True):
        for sample in (False, True):
            copies.clear()
            torch.manual_seed(3)
            outer = merged(model, rows_only=True) if rows_merged else contextlib.nullcontext()
            inner = packed(model) if bf16_packed else contextlib.nullcontext()
            with outer, inner, torch.no_grad(), mock.patch.object(torch.Tensor, "index_copy", counted):
                out[rows_merged, sample] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                          max_new_tokens=12, do_sample=sample, top_k=0,
                                                          pad_token_id=0)
            out[rows_merged, sample, "copies"] = len(copies)
    for sample in (False, True):
        assert torch.equal(out[True, sample], out[False, sample])
        assert out[True, sample, "copies"] == 0  # merged before: the embeddings' and the tied head's, once
        assert out[False, sample, "copies"] >= 2 * 12  # both layers at every step
    assert weight.data.data_ptr() == storage and torch.equal(weight, original) and not embeddings.token_adapter.merged
    assert not model.get_output_embeddings().token_adapter.merged
