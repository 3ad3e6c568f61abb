"""Online RL as a user writes it in TRL, against snaketrl's job, step by step, in one run.

For every online run of the config (bench/rl.yaml: GRPO and RLOO on SmolLM2-135M-Instruct, 16 completions of at
most 64 tokens a step; PPO, 8 completions of at most 24 tokens an update) and every seed, --steps optimizer steps
(PPO: updates) in a process of its own for each arm, every arm with the same model, prompts (the workflow's rows,
as chat turns where it gives them so), reward functions, LoRA, seed, steps, completion cap, generations per prompt,
batch, learning rate and sampling temperature:
  trl           TRL's GRPOTrainer / RLOOTrainer (OnlineDPOTrainer) written plainly, with its defaults for everything
                else (activation checkpointing on; on a CPU bf16 off, which TRL otherwise refuses there)
  trl-tuned     what a user who tunes TRL writes: activation checkpointing off, generation by model.generate
  trl-tuned-cb  the same with use_transformers_continuous_batching=True (on a 2-core EPYC the slower of the two,
                docs/real-model.md: so trl-tuned leaves it off; run both to measure again)
  snaketrl      the workflow's train_run on the run as the config resolves it, with the length stage's choice
                and the plan's decode (compiled on CUDA for a real model's GRPO or RLOO of 8 steps or more; eager for
                bench/rl-gpu.yaml's model, which is built here as a `tiny` entry, and for --steps under 8)
  snaketrl-compiled  the same with its decode compiled on a static cache (snaketrl.train.generation.compile_decode,
                the cache sized for the longest prompt of the rows plus the completion cap; on a CPU through
                transformers' `_compile_all_devices`): the compile is in step 1, which the table leaves out.
                Measured before the plan chooses it on a device (on a CPU it was slower: docs/benchmarks.md; the
                plan chooses it on CUDA for GRPO and RLOO). PPO: the policy's own generation config carries it
                (compile_policy_decode; TRL's loop builds its config in `train`), the cache sized for the longest
                tokenized prompt plus response_length; the plan does not choose it for PPO until a GPU measures it
Each optimizer step is timed on the wall clock and on the process's CPU clock (with one thread on a shared machine
the steadier measure: other load stretches wall time, not a one-thread process's CPU time), and split into
  generation    TRL's `_generate` (sampling the completions)
  scoring       the rest of `_generate_and_score_completions`: reward functions (`_calculate_rewards`, a reward model
                among them), the no-gradient log-probabilities (old and reference policy), advantages, bookkeeping
  trained pass  `training_step` less its `_prepare_inputs` (forward and backward of the loss), plus the optimizer step
  other         what the three leave of the step (gradient clipping, the scheduler, callbacks, splitting the batch):
                small when the seams cover the step (tests/test_bench_rl.py checks it)
by wrapping those methods on the trainer's class in the arm's own process (an override in a subclass is timed
through its call of the base's). Online DPO (trl.experimental.online_dpo: two completions a prompt, the pair ranked
by the reward functions) does all of it in `training_step` (OnlineDPOStepSplit):
  generation    from the step's start to its first forward with gradients (`_generate`, and snaketrl's merged
                weights around it)
  scoring       `_forward` without gradients (the reference pass) and `_calculate_rewards_from_functions`
  trained pass  the rest of `training_step` (forward with gradients, the loss, its statistics, backward) and the
                optimizer step; other as above
PPO (TRL's own loop, trl.experimental.ppo: one optimizer step per minibatch, num_ppo_epochs x num_mini_batches of
them per update) is timed per update, from the previous update's on_step_end (the first: on_train_begin) to its own,
through the loop's module functions and its log call:
  generation    `batch_generation` (sampling the completions; the policy's log-probabilities come from its logits)
  scoring       the rest of the rollout up to the first forward with gradients, less its gc.collect: the
                reference pass (`forward` without gradients), the value and reward models (`get_reward`), the
                policy's log-probabilities from generation's logits, KL, rewards and advantages (GAE)
  trained pass  from the first forward with gradients to the update's log call: the PPO epochs' forwards through
                policy and value model, backward, optimizer steps and their statistics
  other         the rest: TRL's two gc.collect calls an update (timed too: `gc_s`), the next batch of prompts,
                metrics, the scheduler, callbacks
Its reward curve is the reward model's mean score of each update's completions (`objective/scores`, after the
missing-eos penalty). PPO needs a reward model: the config's reward run (`reward_model`), trained by the workflow's
train_run and merged into its base by the workflow's merge (snaketrl.models.merge), once per work dir (--work,
keyed by the reward run's settings). Every arm starts PPO from the base model, also where the run's `policy` names
an SFT run (the bench trains no SFT; it says so). The trl arm is TRL's example script with LoRA: the reference is the
adapter-free policy (ref_model=None), reward and value model loaded from the merged reward model, a "[PAD]" pad
token (TRL's PPO needs one other than eos). PPOConfig's activation_checkpointing defaults to on but its loop never
applies it: the table reports what the policy ran with.
Prints, per arm, the means of the steps after the first (the first pays one-off costs) for the seed of fewest CPU
seconds a step: step and parts (wall / CPU), completions per step second, generated tokens per generation second,
trained real (non-pad) tokens per trained-pass second (wall), peak RSS, each seed's reward curve (mean reward of each
step's completions) and the arm's mean reward against `trl`'s with its standard error over seeds; then the ratios
against `trl` (parts on the CPU clock). --out writes every number (each step of each seed).

    python bench/rl.py --steps 3 --seeds 1 2 --threads 1 --out rl.json    # the CPU table (docs/real-model.md)
    python bench/rl.py --runs grpo-smollm2 --arms trl-tuned trl-tuned-cb --steps 3 --threads 1   # which is faster
    python bench/rl.py --runs ppo-smollm2 --arms trl snaketrl --steps 4 --threads 1 --out ppo.json   # PPO alone
    python bench/rl.py --table rl.json                                        # the table again, from --out's file
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from efficiency import base_model, length_settings, load_config, prepared, run_worker  # noqa: E402

ARMS = ("trl", "trl-tuned", "trl-tuned-cb", "snaketrl", "snaketrl-compiled")
DEFAULT_ARMS = ("trl", "trl-tuned", "snaketrl")
TUNED = {"trl-tuned": {"activation_checkpointing": False},
         "trl-tuned-cb": {"activation_checkpointing": False, "use_transformers_continuous_batching": True}}
ONLINE = ("grpo", "rloo")  # trainers whose steps go through TRL's _generate_and_score_completions
# and online DPO, timed through its training_step (OnlineDPOStepSplit), and PPO through its own loop (PPOStepSplit)
BENCHED = (*ONLINE, "online_dpo", "ppo")
# Arms a trainer has not: TRL's PPO and online DPO have no continuous batching; online DPO's decode is no
# `_generate_single_turn` for snaketrl-compiled to compile (snaketrl.train.generation.COMPILES)
NOT_FOR = {"ppo": ("trl-tuned-cb",), "online_dpo": ("trl-tuned-cb", "snaketrl-compiled")}
PARTS = ("generation", "scoring", "trained", "other")


class StepSplit:
    """Wall seconds of each optimizer step and of its parts, and what the step generated, scored and trained.

    `wrap(cls)` times the trainer class's seams; `callback()` opens and closes each step. Calls outside a step
    (the end-of-training evaluation) are not counted."""

    SEAMS = ("_generate", "_generate_and_score_completions", "_prepare_inputs", "training_step", "_calculate_rewards",
             "_get_per_token_logps_and_entropies")

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict | None = None

    def parts_of(self, raw: dict, clock: str = "") -> dict:
        return parts(raw, clock)

    def wrap(self, cls) -> None:
        for name in self.SEAMS:
            setattr(cls, name, self.timed(getattr(cls, name), name))

    def timed(self, method, name: str):
        import functools

        split = self

        @functools.wraps(method)
        def timed(trainer, *args, **kwargs):
            step = split.current
            if step is None:
                return method(trainer, *args, **kwargs)
            started = clocks()
            key = split.key(step, name, started)
            out = method(trainer, *args, **kwargs)
            add(step, key, started)
            split.count(step, trainer, key, args, out)
            return out

        return timed

    def key(self, step: dict, name: str, started: tuple[float, float]) -> str:
        """The key a call of seam `name` adds its seconds to."""
        import torch

        if name == "_get_per_token_logps_and_entropies":  # the loss's forward has gradients; scoring's none
            return "logps_grad" if torch.is_grad_enabled() else "logps_no_grad"
        return name

    def count(self, step: dict, trainer, key: str, args: tuple, out) -> None:
        """What the call made: rewards, completions and their tokens, trained tokens."""
        if key == "_calculate_rewards":  # (completions x functions), NaN where a function gave none
            weights = trainer.reward_weights.to(out.device).unsqueeze(0)
            step["rewards"] += (out * weights).nansum(dim=1).tolist()
        elif key == "_generate_and_score_completions":
            lengths = out["completion_mask"].sum(dim=1)
            step["completions"] += int(lengths.numel())
            step["generated_tokens"] += int(lengths.sum())
            step["at_cap"] += int((lengths >= trainer.max_completion_length).sum())
        elif key == "_prepare_inputs" and trainer.model.training:
            step["trained_tokens"] += int(out["prompt_mask"].sum() + out["completion_mask"].sum())

    def callback(self):
        from transformers import TrainerCallback

        split = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                split.current = {"completions": 0, "generated_tokens": 0, "trained_tokens": 0, "at_cap": 0,
                                 "rewards": [], "started": clocks()}

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                split.current["optimizer_started"] = clocks()

            def on_optimizer_step(self, args, state, control, **kwargs):
                add(split.current, "optimizer", split.current.pop("optimizer_started"))

            def on_step_end(self, args, state, control, **kwargs):
                step, split.current = split.current, None
                add(step, "step", step.pop("started"))
                split.steps.append(summarize_step(step, split.parts_of))

        return Clock()


def clocks() -> tuple[float, float]:
    """Wall and CPU seconds of this process: with one thread on a shared machine the CPU seconds are the steadier
    measure (other load stretches wall time, not a one-thread process's CPU time)."""
    return time.perf_counter(), time.process_time()


def add(step: dict, key: str, started: tuple[float, float]) -> None:
    """Add the wall and CPU seconds since `started` to the step's `key` (wall) and `key@cpu` (CPU)."""
    now = clocks()
    step[key] = step.get(key, 0.0) + now[0] - started[0]
    step[f"{key}@cpu"] = step.get(f"{key}@cpu", 0.0) + now[1] - started[1]


def parts(raw: dict, clock: str = "") -> dict:
    """The step's parts on one clock ("" wall, "@cpu" CPU): generation, scoring, trained pass, and what they leave."""
    def t(key):
        return raw.get(key + clock, 0.0)

    generation = t("_generate")
    scoring = t("_generate_and_score_completions") - generation
    trained = t("training_step") - t("_prepare_inputs") + t("optimizer")
    return {"generation": generation, "scoring": scoring, "trained": trained,
            "other": t("step") - generation - scoring - trained}


def summarize_step(raw: dict, parts_of=parts) -> dict:
    """One step's record: its parts in wall and CPU seconds, what it generated and trained, its mean reward."""
    rewards = raw["rewards"]
    return {"step_s": raw["step"], "cpu_s": raw["step@cpu"],
            **{f"{part}_s": seconds for part, seconds in parts_of(raw).items()},
            **{f"{part}_cpu_s": seconds for part, seconds in parts_of(raw, "@cpu").items()},
            # reward functions (GRPO, RLOO) or PPO's reward and value models; reference (and old) log-probabilities
            "rewards_s": raw.get("_calculate_rewards", 0.0) + raw.get("get_reward", 0.0),
            "logps_s": raw.get("logps_no_grad", 0.0), "optimizer_s": raw.get("optimizer", 0.0),
            **({"rlhf_reward": raw["rlhf_reward"]} if "rlhf_reward" in raw else {}),
            **({"gc_s": raw.get("gc_rollout", 0.0) + raw.get("gc_other", 0.0),  # TRL's gc.collect (in `other`)
                "gc_cpu_s": raw.get("gc_rollout@cpu", 0.0) + raw.get("gc_other@cpu", 0.0)}
               if "rlhf_reward" in raw else {}),
            "completions": raw["completions"], "generated_tokens": raw["generated_tokens"],
            "trained_tokens": raw["trained_tokens"], "at_cap": raw["at_cap"],
            "reward": statistics.fmean(rewards) if rewards else None}


class OnlineDPOStepSplit(StepSplit):
    """StepSplit for TRL's online DPO, whose `training_step` generates, scores and trains in one call: `wrap(cls)`
    times it, `_forward` (with gradients: the trained pass; without: the reference pass) and
    `_calculate_rewards_from_functions`, and counts what `_generate` made. Generation is the step's start up to its
    first forward with gradients: the sampling of two completions a prompt, with what snaketrl puts around it (its
    merged weights, snaketrl.train.generation, patch the trainer's own `_generate`, outside the class's)."""

    SEAMS = ("training_step", "_generate", "_forward", "_calculate_rewards_from_functions")

    def parts_of(self, raw: dict, clock: str = "") -> dict:
        def t(key):
            return raw.get(key + clock, 0.0)

        generation = t("generation")
        scoring = t("logps_no_grad") + t("_calculate_rewards")
        trained = t("training_step") - generation - scoring + t("optimizer")
        return {"generation": generation, "scoring": scoring, "trained": trained,
                "other": t("step") - generation - scoring - trained}

    def key(self, step: dict, name: str, started: tuple[float, float]) -> str:
        import torch

        if name == "training_step":
            step["training_started"] = started
        elif name == "_forward":
            key = "logps_grad" if torch.is_grad_enabled() else "logps_no_grad"
            if key == "logps_grad" and "training_started" in step:
                add(step, "generation", step.pop("training_started"))
            return key
        return {"_calculate_rewards_from_functions": "_calculate_rewards"}.get(name, name)

    def count(self, step: dict, trainer, key: str, args: tuple, out) -> None:
        if key == "_generate":  # (prompt ids, prompt mask, completion ids, completion mask)
            lengths = out[3].sum(dim=1)
            step["completions"] += int(lengths.numel())
            step["generated_tokens"] += int(lengths.sum())
            step["at_cap"] += int((lengths >= trainer.generation_config.max_new_tokens).sum())
        elif key == "logps_grad":  # (model, prompt ids, prompt mask, completion ids, completion mask)
            step["trained_tokens"] += int(args[2].sum() + args[4].sum())
        elif key == "_calculate_rewards":  # weighted and summed: one a completion
            step["rewards"] += out.tolist()


class PPOStepSplit:
    """StepSplit for TRL's PPO loop: each update's wall and CPU seconds, its parts, and what it generated, trained
    and scored. TRL's loop calls no on_step_begin and runs its parts through module functions: `wrap(module)` times
    `batch_generation`, `forward` and `get_reward` in trl.experimental.ppo.ppo_trainer (the loop looks them up
    there at each call) and the PPOTrainer's `log`; `callback()` opens the first update at on_train_begin and
    each next one at the previous one's on_step_end, where it closes it. The update after the last never closes."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict | None = None
        self.checkpointing: bool | None = None  # what the policy trained with (PPOConfig's flag is not applied)
        self.sampling = False

    def wrap(self, module) -> None:
        import types

        for name in ("batch_generation", "forward", "get_reward"):
            setattr(module, name, self.timed(getattr(module, name), name))
        module.PPOTrainer.log = self.logged(module.PPOTrainer.log)
        module.PPOTrainer.generate_completions = self.unmeasured(module.PPOTrainer.generate_completions)
        # TRL's loop calls gc.collect() twice an update (in the rollout and after it), each a scan of every live
        # object: the module's own `gc` is swapped for a copy whose collect is timed
        timed_gc = types.ModuleType("gc")
        timed_gc.__dict__.update(vars(module.gc))
        timed_gc.collect = self.timed(module.gc.collect, "gc")
        module.gc = timed_gc

    def timed(self, function, name: str):
        import functools

        import torch

        split = self

        @functools.wraps(function)
        def timed(*args, **kwargs):
            step = split.current
            if step is None or split.sampling:  # outside an update, or sampling eval completions (in `other`)
                return function(*args, **kwargs)
            started = clocks()
            key = name
            if name == "batch_generation":
                step.setdefault("rollout_started", started)
            elif name == "forward":
                key = "trained_forward" if torch.is_grad_enabled() else "logps_no_grad"
                if key == "trained_forward":
                    step.setdefault("trained_started", started)
            elif name == "gc":  # the rollout's collect is no part of scoring: it goes to `other` (ppo_parts)
                key = "gc_rollout" if "rollout_started" in step and "trained_started" not in step else "gc_other"
            out = function(*args, **kwargs)
            add(step, key, started)
            if name == "batch_generation":  # (model, queries, rollout batch, pad id, generation config)
                model, queries = args[0], args[1]
                responses = out[0][:, queries.shape[1]:]
                lengths, ended = completion_lengths(responses, model.generation_config.eos_token_id)
                step["completions"] += int(lengths.numel())
                step["generated_tokens"] += int(lengths.sum())
                step["at_cap"] += int((~ended).sum())
            elif key == "trained_forward":  # (model, query_responses, pad id): the rows' real tokens
                step["trained_tokens"] += int((args[1] != args[2]).sum())
            return out

        return timed

    def unmeasured(self, method):
        """`method` (TRL's sampling of eval completions, every num_total_batches // num_sample_generations updates)
        counts in no part but `other`, its generation and passes too."""
        import functools

        split = self

        @functools.wraps(method)
        def unmeasured(*args, **kwargs):
            split.sampling = True
            try:
                return method(*args, **kwargs)
            finally:
                split.sampling = False

        return unmeasured

    def logged(self, log):
        import functools

        split = self

        @functools.wraps(log)
        def logged(trainer, logs, *args, **kwargs):
            step = split.current
            if step is not None and "objective/scores" in logs:  # the update's metrics, after its PPO epochs
                step.setdefault("logged", clocks())
                step["rewards"].append(logs["objective/scores"])
                step["rlhf_reward"] = logs["objective/rlhf_reward"]
            return log(trainer, logs, *args, **kwargs)

        return logged

    def open(self) -> None:
        self.current = {"completions": 0, "generated_tokens": 0, "trained_tokens": 0, "at_cap": 0, "rewards": [],
                        "started": clocks()}

    def callback(self):
        from transformers import TrainerCallback

        split = self

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
                split.checkpointing = bool(model.policy.is_activation_checkpointing)
                optimizer.step = split.timed_optimizer(optimizer.step)
                split.open()

            def on_step_end(self, args, state, control, **kwargs):
                step = split.current
                add(step, "step", step.pop("started"))
                split.steps.append(summarize_step(step, ppo_parts))
                split.open()

            def on_train_end(self, args, state, control, **kwargs):
                split.current = None

        return Clock()

    def timed_optimizer(self, step_fn):
        import functools

        split = self

        @functools.wraps(step_fn)
        def timed(*args, **kwargs):
            if split.current is None:
                return step_fn(*args, **kwargs)
            started = clocks()
            out = step_fn(*args, **kwargs)
            add(split.current, "optimizer", started)
            return out

        return timed


def completion_lengths(responses, eos):
    """Each completion's tokens up to and with its first `eos` (its whole width where none), and whether it ended."""
    import torch

    width = responses.shape[1]
    if eos is None:
        return torch.full((responses.shape[0],), width), torch.zeros(responses.shape[0], dtype=torch.bool)
    is_eos = torch.isin(responses, torch.tensor(eos, device=responses.device).reshape(-1))
    ended = is_eos.any(dim=1)
    first = torch.where(ended, is_eos.int().argmax(dim=1) + 1, torch.full_like(ended, width, dtype=torch.long))
    return first, ended


def ppo_parts(raw: dict, clock: str = "") -> dict:
    """A PPO update's parts on one clock: generation, the rest of the rollout (scoring), the PPO epochs (trained
    pass, up to the update's log call), and what they leave."""
    index = 1 if clock else 0

    def t(key):
        return raw.get(key + clock, 0.0)

    generation, collect = t("batch_generation"), t("gc_rollout")
    rollout = raw["trained_started"][index] - raw["rollout_started"][index]
    trained = raw["logged"][index] - raw["trained_started"][index]
    return {"generation": generation, "scoring": rollout - generation - collect, "trained": trained,
            "other": t("step") - rollout - trained + collect}


def trl_bf16(job: dict) -> bool:
    """Whether a plain TRL arm trains in bf16: TRL's default where a GPU supports it (TRL refuses it on a CPU),
    unless --fp32."""
    import torch

    return not job.get("fp32") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def plain_trl(job: dict, callbacks: list) -> dict:
    """The user's alternative: TRL's trainer with its defaults, the shared settings and the arm's tuning."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketrl.data.chat import as_chat
    from snaketrl.io import read_jsonl
    from snaketrl.rewards import resolve
    from snaketrl.trainers import REGISTRY, load

    run, spec = job["run"], REGISTRY[job["run"]["trainer"]]
    bf16 = trl_bf16(job)
    config = load(spec.config)(output_dir=job["work"] + "/out", seed=job["seed"],
                               **{"bf16": bf16, **run["args"], **job["schedule"], **TUNED.get(job["arm"], {})})
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.bfloat16 if bf16 else torch.float32)
    rows = read_jsonl(job["train"])
    trainer = load(spec.trainer)(model=model, args=config, processing_class=tokenizer,
                                 reward_funcs=resolve(run["reward_funcs"]),
                                 train_dataset=Dataset.from_list(as_chat(rows) if run.get("chat") else rows),
                                 peft_config=LoraConfig(task_type="CAUSAL_LM", **run["lora"]), callbacks=callbacks)
    trainer.train()
    return {"activation_checkpointing": config.activation_checkpointing, "bf16": config.bf16,
            "continuous_batching": getattr(config, "use_transformers_continuous_batching", False)}  # online DPO has none


def plain_trl_ppo(job: dict, callbacks: list) -> dict:
    """The user's PPO: TRL's example script (trl/examples/scripts/ppo) with LoRA, its defaults, the shared settings
    and the arm's tuning. The prompts are the workflow's token ids (the same in every arm)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from snaketrl.io import read_jsonl

    run = job["run"]
    bf16 = trl_bf16(job)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = PPOConfig(output_dir=job["work"] + "/out", seed=job["seed"],
                       **{"bf16": bf16, **run["args"], **job["schedule"], **TUNED.get(job["arm"], {})})
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"], padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # as TRL's example: its masks need a pad other than eos
    policy = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype)
    reward_model, value_model = (AutoModelForSequenceClassification.from_pretrained(job["reward_dir"], num_labels=1,
                                                                                    dtype=dtype) for _ in range(2))
    evals = read_jsonl(job["eval"])[:run.get("eval_rows") or None]
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward_model, value_model=value_model,
                         train_dataset=Dataset.from_list(read_jsonl(job["train"])),
                         eval_dataset=Dataset.from_list(evals),
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **run["lora"]), callbacks=callbacks)
    trainer.train()
    return {"activation_checkpointing": config.activation_checkpointing, "bf16": config.bf16,
            "continuous_batching": False}


def snaketrl_job(job: dict, callbacks: list) -> dict:
    from snaketrl.data.lengths import histogram
    from snaketrl.train.run import train_run

    work = Path(job["work"])
    lengths = job.get("lengths")  # PPO's: the length stage ran before its prompts were tokenized
    if not lengths:
        lengths = work / "lengths.json"
        histogram(job["model_dir"], job["train"], job["settings"], lengths, work / "lengths.png", job["run"]["name"])
    fp32 = {"bf16": False} if job.get("fp32") else {}  # a config may turn bf16 off, never on
    run = {**job["run"], "seed": job["seed"], "args": {**job["run"]["args"], **job["schedule"], **fp32}}
    metrics = train_run(run, model_dir=job["model_dir"], train_file=job["train"], eval_file=job["eval"],
                        lengths_file=lengths, out_dir=work / "out", checkpoint_dir=work / "ckpt",
                        reward_dir=job.get("reward_dir"), threads=job.get("threads"), callbacks=callbacks)
    manifest = json.loads((work / "out" / "manifest.json").read_text())["trl_args"]
    return {"activation_checkpointing": metrics["activation_checkpointing"], "bf16": manifest["bf16"],
            "continuous_batching": manifest.get("use_transformers_continuous_batching", False)}


def compiled_on_first_generation(cls) -> None:
    """The trainer class's generation compiles its decode (compile_decode) from its first call on, the static
    cache sized for the longest prompt of its rows (as TRL renders them) plus the completion cap."""
    from trl.data_utils import maybe_apply_chat_template

    from snaketrl.train.generation import compile_decode, static_cache_len

    generate = cls._generate_single_turn

    def generate_compiled(trainer, *args, **kwargs):
        if not getattr(trainer, "_bench_compiled", False):
            tokenizer = trainer.processing_class
            longest = max(len(tokenizer(maybe_apply_chat_template({"prompt": row["prompt"]}, tokenizer)["prompt"],
                                        add_special_tokens=False)["input_ids"]) for row in trainer.train_dataset)
            compile_decode(trainer, static_cache_len(longest, trainer.max_completion_length),
                           trainer.accelerator.device.type)
            trainer._bench_compiled = True
        return generate(trainer, *args, **kwargs)

    cls._generate_single_turn = generate_compiled


def compiled_ppo(cls) -> None:
    """The PPO trainer class's `train` first compiles the policy's decode (compile_policy_decode), the static cache
    sized for the longest prompt of its rows (token ids) plus response_length."""
    from snaketrl.train.generation import compile_policy_decode, static_cache_len

    train = cls.train

    def train_compiled(trainer, *args, **kwargs):
        longest = max(len(ids) for ids in trainer.train_dataset["input_ids"])
        compile_policy_decode(trainer.policy_model, static_cache_len(longest, trainer.args.response_length),
                              trainer.accelerator.device.type)
        return train(trainer, *args, **kwargs)

    cls.train = train_compiled


def worker(job_file: str) -> None:
    """Some steps of one (run, seed, arm); prints one JSON line."""
    import torch

    from snaketrl.manifest import cpu_model
    from snaketrl.trainers import REGISTRY, load

    job = json.loads(Path(job_file).read_text())
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    if job["arm"] == "snaketrl":
        from snaketrl.processes import keep_freed_memory

        keep_freed_memory()  # as every training-side job does (snaketrl.imports.start_job)
    if job["run"]["trainer"] == "ppo":
        from trl.experimental.ppo import ppo_trainer

        split = PPOStepSplit()
        split.wrap(ppo_trainer)
        if job["arm"] == "snaketrl-compiled":
            compiled_ppo(load(REGISTRY["ppo"].trainer))
        plain = plain_trl_ppo
    else:
        split = OnlineDPOStepSplit() if job["run"]["trainer"] == "online_dpo" else StepSplit()
        cls = load(REGISTRY[job["run"]["trainer"]].trainer)
        split.wrap(cls)
        if job["arm"] == "snaketrl-compiled":
            compiled_on_first_generation(cls)
        plain = plain_trl
    settings = (snaketrl_job if job["arm"].startswith("snaketrl") else plain)(job, [split.callback()])
    if isinstance(split, PPOStepSplit):  # what the policy trained with: TRL's PPO loop never applies the flag
        settings["activation_checkpointing"] = split.checkpointing
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"{cpu_model()}, {torch.get_num_threads()} threads"
    print("RESULT " + json.dumps({
        "arm": job["arm"], "seed": job["seed"], "device": f"{device}, torch {torch.__version__}", **settings,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
        "steps": split.steps}), flush=True)


def reward_model(config: dict, runs: dict, run: dict, work: Path, threads: int | None = None) -> Path:
    """PPO run `run`'s reward model as the workflow makes it, once per work dir and reward run settings: the length
    stage, the reward run trained (train_run, the train job's) and its adapter merged into its base (the merge
    job's snaketrl.models.merge), written whole or not at all."""
    from snaketrl.data.lengths import histogram
    from snaketrl.models.merge import merge
    from snaketrl.train.run import fingerprint, train_run
    from snaketrl.trainers import REGISTRY

    reward = runs[run["reward_model"]]
    out = work / "reward" / f"{reward['name']}-{fingerprint(reward)}"
    if (out / "merged").is_dir():
        return out / "merged"
    if reward.get("policy"):
        print(f"{reward['name']}: trained from the base model, not from {reward['policy']} (the bench trains no "
              f"SFT run)", file=sys.stderr)
    base = base_model(config, reward["model"], work)
    train, evals = prepared(config, reward, work)
    histogram(base, train, length_settings(config, reward, None), out / "lengths.json", out / "lengths.png",
              reward["name"], model=reward["model"], dataset=reward["dataset"])
    train_run(reward, model_dir=base, train_file=train, eval_file=evals, lengths_file=out / "lengths.json",
              out_dir=out / "out", checkpoint_dir=out / "ckpt", threads=threads)
    merge(out / "out" / "adapter", base, out / "merged", REGISTRY[reward["trainer"]].task_type, threads=threads)
    return out / "merged"


def ppo_prompts(config: dict, run: dict, model_dir: Path, work: Path) -> tuple[Path, Path, Path]:
    """PPO's train and eval prompts as its job reads them, and the length stage's file: the prepared rows'
    length stage, then their token ids (the workflow's tokenize_prompts job)."""
    from snaketrl.data.lengths import histogram, tokenize_prompt_files

    train, evals = prepared(config, run, work, unique=False)
    batch = ppo_batch(run)
    if len(train.read_text().splitlines()) < batch:  # TRL's loop would wait forever on an empty DataLoader
        sys.exit(f"{train}: fewer prompts than PPO's batch of {batch} (its DataLoader drops a short last batch)")
    out = train.parent / run["model"]
    if not (out / "eval.jsonl").is_file():  # written last
        histogram(model_dir, train, length_settings(config, run, None), out / "lengths.json", out / "lengths.png",
                  run["name"], model=run["model"], dataset=run["dataset"])
        tokenize_prompt_files(model_dir, out / "lengths.json",
                              {"train": (train, out / "train.jsonl"), "eval": (evals, out / "eval.jsonl")})
    return out / "train.jsonl", out / "eval.jsonl", out / "lengths.json"


def ppo_schedule(run: dict, steps: int) -> dict:
    """`steps` PPO updates: TRL's loop runs total_episodes / (per_device_train_batch_size x gradient_accumulation)
    of them on one process, whatever max_steps says."""
    return {"total_episodes": steps * ppo_batch(run), "save_strategy": "no", "eval_strategy": "no",
            "logging_steps": 1}


def ppo_batch(run: dict) -> int:
    """Completions of a PPO update on one process: per_device_train_batch_size x gradient_accumulation_steps."""
    from trl.experimental.ppo import PPOConfig

    defaults = PPOConfig.__dataclass_fields__
    return (run["args"].get("per_device_train_batch_size", defaults["per_device_train_batch_size"].default)
            * run["args"].get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"].default))


def measure(job: dict) -> dict:
    result, stderr = run_worker(__file__, job)
    if result is None:
        print(f"{job['run']['name']} {job['arm']} seed {job['seed']} failed:\n{stderr[-3000:]}", file=sys.stderr)
        return {"arm": job["arm"], "seed": job["seed"], "failed": stderr.strip().splitlines()[-1:]}
    return result


def seed_summary(result: dict) -> dict:
    """One seed's means per step over its steps after the first (all of them when there is one), and its rates."""
    steps = result["steps"][1:] or result["steps"]
    total = {key: sum(s[key] for s in steps) for key in steps[0] if key != "reward"}
    return {**{key: value / len(steps) for key, value in total.items() if key.endswith("_s")},
            "completions_per_s": total["completions"] / total["step_s"],
            "generated_tokens_per_s": total["generated_tokens"] / total["generation_s"],
            "trained_tokens_per_s": total["trained_tokens"] / total["trained_s"],
            "at_cap": total["at_cap"] / total["completions"],
            "rewards": [s["reward"] for s in result["steps"]], "peak_rss_mb": result["peak_rss_mb"]}


def reward_change(rewards: list[list[float]], base: list[list[float]]) -> str:
    """The change of the mean reward (over steps, then seeds) against `trl`'s, with the standard error of a
    difference of two means over seeds (Welch); within seed noise when under two standard errors."""
    mean = [statistics.fmean(r) for r in rewards]
    base_mean = [statistics.fmean(r) for r in base]
    change = statistics.fmean(mean) - statistics.fmean(base_mean)
    if min(len(mean), len(base_mean)) < 2:
        return f"{change:+.3f}"
    se = (statistics.variance(mean) / len(mean) + statistics.variance(base_mean) / len(base_mean)) ** 0.5
    verdict = "within seed noise" if abs(change) <= max(2 * se, 0.0005) else "beyond seed noise"
    return f"{change:+.3f} (SE {se:.3f}: {verdict})"


def table(name: str, results: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """Markdown rows of one run (each arm's seed of fewest CPU seconds a step, then ratios to `trl`) and the
    summaries they show. A part reads `wall / CPU` seconds where the steps were timed on both clocks."""
    def part(b, key):
        return f"{b[key + '_s']:.2f} / {b[key + '_cpu_s']:.2f}" if key + "_cpu_s" in b else f"{b[key + '_s']:.2f}"

    def faster(base, b, key):  # on the CPU clock where both have it
        key += "_cpu_s" if key + "_cpu_s" in base and key + "_cpu_s" in b else "_s"
        return f"{base[key] / b[key]:.2f}×"

    rows, best = [], {}
    for arm, rs in results.items():
        failed = [r for r in rs if "failed" in r]
        if failed:
            rows.append(f"| {name} | {arm} | failed: {' '.join(failed[0]['failed'])} |" + " |" * 11)
            continue
        seeds = [seed_summary(r) for r in rs]
        best[arm] = min(seeds, key=lambda s: s["cpu_s"])
        b, r = best[arm], rs[0]
        how = (f"checkpointing {'on' if r['activation_checkpointing'] else 'off'}, "
               f"{'bf16' if r['bf16'] else 'fp32'}{', continuous batching' if r['continuous_batching'] else ''}")
        curves = "; ".join(" ".join(f"{x:.2f}" for x in s["rewards"]) for s in seeds)
        change = "" if arm == "trl" or "trl" not in best else reward_change(
            [s["rewards"] for s in seeds], [seed_summary(x)["rewards"] for x in results["trl"]])
        rows.append(f"| {name} | {arm} ({how}) | {b['step_s']:.1f} | {b['cpu_s']:.1f} | {part(b, 'generation')} "
                    f"| {part(b, 'scoring')} | {part(b, 'trained')} | {part(b, 'other')} "
                    f"| {b['completions_per_s']:.3f} | {b['generated_tokens_per_s']:.1f} "
                    f"| {b['trained_tokens_per_s']:.0f} | {b['peak_rss_mb']:.0f} | {curves} | {change} |")
    if "trl" in best:
        base = best["trl"]
        for arm, b in best.items():
            if arm != "trl":
                rows.append(f"| {name} | **{arm} / trl** | {base['step_s'] / b['step_s']:.2f}× "
                            f"| **{base['cpu_s'] / b['cpu_s']:.2f}×** | {faster(base, b, 'generation')} "
                            f"| {faster(base, b, 'scoring')} | {faster(base, b, 'trained')} | "
                            f"| {b['completions_per_s'] / base['completions_per_s']:.2f}× "
                            f"| {b['generated_tokens_per_s'] / base['generated_tokens_per_s']:.2f}× "
                            f"| {b['trained_tokens_per_s'] / base['trained_tokens_per_s']:.2f}× "
                            f"| {b['peak_rss_mb'] / base['peak_rss_mb']:.2f}× | | |")
    return rows, best


HEADER = ["| run | arm | step (s) | CPU (s) | generation (s) | scoring (s) | trained pass (s) | other (s) | completions/s "
          "| generated tokens/s | trained tokens/s | peak RSS (MB) | reward per step (each seed) | mean reward vs trl |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", type=Path, default=ROOT / "bench" / "rl.yaml")
    ap.add_argument("--runs", nargs="*", help="run names (default: every GRPO, RLOO, online DPO and PPO run)")
    ap.add_argument("--arms", nargs="*", default=list(DEFAULT_ARMS), choices=ARMS)
    ap.add_argument("--seeds", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps of every arm")
    ap.add_argument("--fp32", action="store_true",
                    help="every arm in fp32 (snaketrl's job also where it would train in bf16): the same numbers, "
                         "so the same tokens where the arms agree")
    ap.add_argument("--threads", type=int, help="torch threads of every arm (default: torch's, all cores)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/snaketrl-bench-rl"))
    ap.add_argument("--out", type=Path, help="a JSON file: every arm's settings and steps, and the table's numbers")
    ap.add_argument("--table", type=Path, help="print the table again from a file --out wrote (measures nothing)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.worker:
        return worker(opts.worker)
    if opts.table:
        report = json.loads(opts.table.read_text())
        print(f"device: {report['device']}")
        print("\n".join(HEADER + [row for name, run in report["runs"].items()
                                   for row in table(name, run["results"])[0]]))
        return

    import contextlib
    import os

    configfile = opts.configfile.resolve()
    os.chdir(ROOT)  # config paths are relative to the project, as for Snakemake
    config, runs = load_config(configfile)
    names = opts.runs or [n for n, r in runs.items() if r["trainer"] in BENCHED]
    unknown = [n for n in names if n not in runs or runs[n]["trainer"] not in BENCHED]
    if unknown:
        sys.exit(f"{configfile}: --runs {' '.join(unknown)}: expected GRPO, RLOO, online DPO or PPO runs of the config "
                 f"({', '.join(n for n, r in runs.items() if r['trainer'] in BENCHED)})")
    out, report, device = list(HEADER), {"command": sys.argv, "runs": {}}, None
    for name in names:
        run = runs[name]
        schedule = {"max_steps": opts.steps, "save_strategy": "no", "eval_strategy": "no", "logging_steps": 1}
        inputs, arms = {}, [arm for arm in opts.arms if arm not in NOT_FOR.get(run["trainer"], ())]
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the table
            model_dir = base_model(config, run["model"], opts.work)
            if run["trainer"] == "ppo":
                schedule = ppo_schedule(run, opts.steps)
                if run.get("policy"):
                    print(f"{name}: every arm starts from the base model, not from {run['policy']} (the bench "
                          f"trains no SFT run)", file=sys.stderr)
                train, evals, lengths = ppo_prompts(config, run, model_dir, opts.work)
                inputs = {"lengths": str(lengths),
                          "reward_dir": str(reward_model(config, runs, run, opts.work, opts.threads))}
            else:
                train, evals = prepared(config, run, opts.work)
        results = {}
        for arm in arms:
            for seed in opts.seeds:
                job = {"run": run, "arm": arm, "seed": seed, "settings": length_settings(config, run, "auto"),
                       "model_dir": str(model_dir), "schedule": schedule, "threads": opts.threads,
                       "train": str(train), "eval": str(evals), **inputs,
                       "fp32": opts.fp32, "work": str(opts.work / "runs" / name / f"{arm}-{seed}")}
                result = measure(job)
                device = result.get("device", device)
                print(f"{name} {arm} seed {seed}: {json.dumps(result)}", file=sys.stderr, flush=True)
                results.setdefault(arm, []).append(result)
        rows, best = table(name, results)
        out += rows
        report["runs"][name] = {"results": results, "best_seed": best}
    report["device"] = device
    print(f"device: {device}")
    print("\n".join(out))
    if opts.out:
        opts.out.write_text(json.dumps({**report, "table": out}, indent=1))


if __name__ == "__main__":
    main()
