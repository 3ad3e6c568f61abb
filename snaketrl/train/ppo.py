"""TRL's PPOTrainer, resumable like every other trainer.

trl 1.12's `PPOTrainer.train()` is one loop with no `resume_from_checkpoint`. It already writes a
checkpoint at each `save_steps` update (policy adapter, optimizer, scheduler, RNG states, trainer state),
but not the value model nor where its endless dataloader stands. This subclass adds those two, and on a
resume loads everything back and lets TRL's own loop run the remaining updates: nothing of the loop is
copied, so it stays TRL's algorithm.

TRL's loop takes every token equal to the pad id for padding, sampled ones too: a completion is cut at it, scored
there and masked after it. So the loop gets a pad id no logit samples (`unsampled_pad`), as TRL's example script's
"[PAD]" beyond the vocabulary; the workflow's own pad (snaketrl.models.tokenizer) is an id of the vocabulary.

TRL's loop holds three vocabulary-wide tensors an update (`bound_logits` bounds them where they exceed a chunk,
snaketrl.train.logps.CHUNK_BYTES): the generation's processed scores of every decode step (rows x completion x
vocabulary, fp32, stacked and padded: three copies), and the reference's and the trained pass's logits of every
position of prompt and completion (the trained ones with their gradients). At Gemma 3's 262,144 entries, 16 rows
of 48 completion tokens are 0.8 GB per copy of scores; a Gemma PPO job peaked at 22 GB (issue 54). Bounded, each
decode step's scores become the drawn token's log-prob once it is drawn (`StepLogps`), and the two passes return
their hidden states in place of logits: the log-probs of the completion tokens are projected from them a chunk at
a time, each chunk recomputed in the backward pass, and the trained pass's logged entropy with them. The value and
reward models score from their backbones (TRL's get_reward): no vocabulary there. The same values as TRL's path,
float rounding aside (tests/test_ppo_logits.py). Gemma 3 270M on a CPU, 4 rows of 32 completion tokens
(bench/vocab_memory.py): peak resident memory 5.42 GiB against TRL's path's 5.94, the last update adding 1.08 GiB
against 1.40.

TRL's loop scores a completion with the reward model at its last token, the eos it was cut after. A reward model
trained on chat turns (TRL's RewardTrainer renders them with the template) read every text to the template's end
of turn, which for ChatML or Gemma goes on past eos (`<|im_end|>\n`). Scored at eos, a position no training text
ended on, the reward model rewarded ending at once: on SmolLM2 PPO's completions scored 3.86 there and 1.68 read
to the template's end, the base's 2.81 and 2.90 (docs/real-model.md). So where the run's prompts are chat turns,
the reward model reads each completion that ended with eos to the template's end (`turn_end`, `with_turn_end`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import time
from pathlib import Path

import torch
from accelerate.data_loader import get_sampler
from transformers import StoppingCriteria, StoppingCriteriaList, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from trl.experimental.ppo import PPOTrainer as TRLPPOTrainer
from trl.experimental.ppo import ppo_trainer as trl_ppo

from snaketrl.errors import DataError, SnaketrlError
from snaketrl.train import logps as chunks
from snaketrl.train.generation import merged
from snaketrl.train.head import one_weight_forward, vocabulary

VALUE_MODEL = "value_model.safetensors"
PAD = "<|snaketrl_ppo_pad|>"


def unsampled_pad(tokenizer, logits: int):
    """A copy of `tokenizer` whose pad token has an id of `logits` or above (the policy's logits: the ids it can
    sample), so that no sampled token is taken for padding. TRL's loop replaces pad ids by 0 before every forward,
    so the id needs no embedding. Where the vocabulary is shorter than the logits (Qwen2.5: 151,665 tokens, 151,936
    logits), unused tokens fill the ids in between."""
    tokenizer = copy.deepcopy(tokenizer)
    fillers = [f"<|snaketrl_ppo_unused_{i}|>" for i in range(logits - len(tokenizer))]
    if fillers:
        tokenizer.add_tokens(fillers, special_tokens=True)
    tokenizer.add_special_tokens({"pad_token": PAD})
    if tokenizer.pad_token_id < logits:
        raise SnaketrlError(f"PPO's pad token {PAD} got id {tokenizer.pad_token_id}, one the policy's {logits} "
                            f"logits can sample")
    return tokenizer


def logit_count(model) -> int:
    """How many ids `model` samples from: its output projection's features (its weight may be a ZeRO-3 shard)."""
    return model.get_output_embeddings().out_features


def turn_end(tokenizer) -> list[int]:
    """The token ids the tokenizer's chat template writes after eos at the end of an assistant turn ([] where it
    writes none, or has no template): ChatML's "\n" after `<|im_end|>`."""
    template, eos = getattr(tokenizer, "chat_template", None), tokenizer.eos_token
    if not template or not eos:
        return []
    marker = "snaketrl-turn"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    end = text.find(eos, text.rfind(marker))
    return [] if end < 0 else tokenizer(text[end + len(eos):], add_special_tokens=False).input_ids


def with_turn_end(query_responses, context_length: int, eos: int, pad: int, tail: list[int]):
    """`query_responses` (prompts of `context_length`, then responses cut after eos and padded) with `tail` written
    after each response's first eos, the rows widened by pads where a tail would not fit."""
    if not tail:
        return query_responses
    out = torch.cat([query_responses, query_responses.new_full((query_responses.shape[0], len(tail)), pad)], 1)
    ends = (query_responses[:, context_length:] == eos).int().argmax(1) + context_length
    for row, end in enumerate(ends.tolist()):
        if query_responses[row, end] == eos:
            out[row, end + 1:end + 1 + len(tail)] = out.new_tensor(tail)
    return out


def data_state_name(process_index: int) -> str:
    return f"ppo_data_{process_index}.pt"


class ReplayableLoader:
    """Iterates a dataloader pass after pass, as TRL's `repeat_generator` asks, and knows where it is.

    A shuffling pass draws its order from the RNG at the pass's first batch (torch's global RNG on one
    process, the sampler's generator under accelerate's multi-process sharding), and by then generation
    has drawn from the same RNG. So the position is the RNG state each pass began with plus the batches
    taken from it: a resumed run rebuilds that pass from that state, takes as many batches, and only
    then gets the checkpoint's RNG state back.
    """

    def __init__(self, loader):
        self.loader = loader
        self.passes = 0  # passes begun
        self.taken = 0  # batches taken from the current pass
        self.start: dict | None = None
        self._current = None

    def __iter__(self):
        current, self._current = self._current, None
        return current if current is not None else self._pass()

    def _pass(self):
        self.start = self._rng_states()
        self.passes += 1
        self.taken = 0
        for batch in self.loader:
            self.taken += 1
            yield batch

    def _generator(self):
        generator = getattr(get_sampler(self.loader), "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def _rng_states(self) -> dict:
        generator = self._generator()
        return {"cpu": torch.get_rng_state(), "sampler": generator.get_state() if generator is not None else None}

    def state_dict(self) -> dict:
        return {"passes": self.passes, "taken": self.taken, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        """Rebuild the pass `state` was in, up to its batch; this draws from the RNG (restore it after)."""
        if not state["passes"]:
            return
        torch.set_rng_state(state["start"]["cpu"])
        if state["start"]["sampler"] is not None:
            self._generator().set_state(state["start"]["sampler"])
        if hasattr(self.loader, "iteration"):  # accelerate's pass counter (a seedable sampler's epoch)
            self.loader.iteration = state["passes"] - 1
        self.passes = state["passes"] - 1
        current = self._pass()
        for _ in range(state["taken"]):
            next(current)
        self._current = current


class StepLogps(StoppingCriteria):
    """A stopping criterion that stops nothing: once a decode step's token is drawn, it turns that step's processed
    scores (the last of generate's `scores`, rows x vocabulary) into the drawn token's log-prob (rows x 1), in
    place, so that one step's scores are held at a time. TRL's loop stacks them as its `logitss`."""

    def __call__(self, input_ids, scores, **kwargs):
        from trl.trainer.utils import selective_log_softmax

        last = scores[-1]
        last.set_(selective_log_softmax(last, input_ids[:, -1]).unsqueeze(-1))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Scoring:
    """The policy as TRL's `generate` sees it: its generate with StepLogps among the stopping criteria."""

    def __init__(self, model):
        self.model = model

    @property
    def generation_config(self):  # the policy's (its eos), for whoever reads it of the model TRL's loop was given
        return self.model.generation_config

    def generate(self, **kwargs):
        return self.model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([StepLogps()]))


class _Hidden:
    """A pass's hidden states where TRL's loop expects its logits: TRL slices the stand-in (rows x positions x 1)
    that carries this, and the slice it scores names the rows and positions to project."""

    def __init__(self, hidden, head, autocast):
        self.hidden, self.head, self.autocast = hidden, head, autocast

    def logps(self, stand_in, index, temperature: float, entropies: list | None):
        """TRL's log-probs of `index` from the logits of the positions `stand_in` (a slice of this pass's stand-in)
        covers, divided by `temperature` as TRL divides them, a chunk at a time; with `entropies`, the mean of their
        entropies (TRL's formula, without gradient) is appended to it."""
        from trl.trainer.utils import selective_log_softmax

        root = stand_in._base if stand_in._base is not None else stand_in
        if stand_in.stride()[:2] != root.stride()[:2]:
            raise SnaketrlError("PPO's bounded logits: TRL's loop sliced a pass's logits in a way not foreseen")
        row, position = divmod(stand_in.storage_offset() - root.storage_offset(), root.stride(0))
        rows, positions = index.shape
        hidden = self.hidden[row:row + rows, position:position + positions]
        flat, ids = hidden.reshape(rows * positions, hidden.shape[-1]), index.reshape(-1)
        head, autocast = self.head, self.autocast
        project = one_weight_forward(head)  # a head that trains rows: its weight built once for every chunk

        def chunk(h, t):
            with autocast:  # the layer's own forward (peft's, where it trains rows), its hooks not run again
                logits = project(h)
            logits /= temperature
            logp = selective_log_softmax(logits, t)
            if entropies is None:
                return logp, None
            with torch.no_grad():  # as TRL's loop logs it; the backward pass's recomputation stops before it
                probs = torch.nn.functional.softmax(logits, dim=-1)
                return logp, torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)

        parts = chunks.over_chunks(chunk, flat, ids, chunks.chunk_positions(vocabulary(head), 4))
        if entropies is not None:
            entropies.append(torch.cat([p[1] for p in parts]).view(rows, positions).mean().float())
        return torch.cat([p[0] for p in parts]).view(rows, positions)


class _Stop(Exception):
    """Ends TRL's PPO loop from its log call."""


class _Resume(TrainerCallback):
    """Puts the checkpoint's counters, log and RNG back after TRL's train() has zeroed its state, before
    its first update."""

    def __init__(self, trainer: PPOTrainer, checkpoint: str, saved: dict, max_steps: int):
        self.trainer, self.checkpoint, self.saved, self.max_steps = trainer, checkpoint, saved, max_steps

    def on_train_begin(self, args, state, control, **kwargs):
        for key in ("global_step", "episode", "epoch", "log_history", "total_flos", "stateful_callbacks"):
            setattr(state, key, self.saved[key])
        state.max_steps = self.max_steps  # TRL set it to the updates left; save and stop decisions need all
        self.trainer._load_rng_state(self.checkpoint)


class _ReplaySampling(TrainerCallback):
    """An uninterrupted run samples right after saving at the resumed step; the sampling draws from the RNG
    (and its forward passes count towards the next update's cost). Last of the callbacks: the others' hooks
    (snaketrl.train.tokens) are in place by then, as they were in the uninterrupted run."""

    def __init__(self, trainer: PPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.generate_completions(sampling=True)


class PPOTrainer(TRLPPOTrainer):
    """`train(resume_from_checkpoint=...)` continues from a checkpoint this class wrote; `train()` stops at the
    log where a callback sets `should_training_stop`, and ends with the summary entry (runtime) other trainers
    add to `log_history`."""

    own_loop = True  # TRL's loop, not transformers': snaketrl.train.checkpoints leaves the rest of its resume here

    def __init__(self, *, processing_class, model, **kwargs):
        super().__init__(processing_class=unsampled_pad(processing_class, logit_count(model)), model=model, **kwargs)
        # Launched, accelerate wraps TRL's policy-and-value model in DistributedDataParallel, and TRL reaches
        # for `.policy` on the wrapped model (the reference pass, save_model; TRL issue 2375). The wrapper
        # gets the names without registering the modules again (DeepSpeed's engine forwards them itself).
        inner = self.accelerator.unwrap_model(self.model)
        if inner is not self.model and not hasattr(self.model, "policy"):
            for name in ("policy", "value_model", "config"):
                object.__setattr__(self.model, name, getattr(inner, name))
        # Read by transformers' _save on every rank but the writer; TRL's __init__ never runs Trainer's, which sets it.
        self.is_distributed_loading_by_transformers = False
        self._training = False
        self._passes = ReplayableLoader(self.dataloader)
        # TRL samples when the loop's update count, which restarts at 1 on a resume, hits its period: it
        # now asks every update, and generate_completions decides from the global step instead.
        self._sample_every = self.sample_generations_freq if self.args.num_sample_generations > 0 else None
        if self._sample_every:
            self.sample_generations_freq = 1
        self._bounded = self._within = False  # bound_logits turns the first on; _patched the second
        self._turn_end: list[int] = []  # score_to_turn_end sets it
        self._entropies: list = []  # the trained passes' mean entropies since the last log, where bounded

    def _patched(self):
        """Within: TRL's loop, which looks its functions up by name, runs this trainer's versions of them: the
        bounded generation, passes and log-probs (`bound_logits`, TRL's own path where a tensor fits a chunk), and
        the reward model reading each completion to its turn's end (`score_to_turn_end`)."""
        patches = [("batch_generation", self._batch_generation), ("forward", self._forward),
                   ("selective_log_softmax", self._selective_log_softmax)] if self._bounded else []
        patches += [("get_reward", self._get_reward)] if self._turn_end else []
        if not patches or self._within:  # generate_completions runs within train too
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        self._within = True
        stack.callback(setattr, self, "_within", False)
        for name, patch in patches:
            stack.callback(setattr, trl_ppo, name, getattr(trl_ppo, name))
            setattr(trl_ppo, name, patch(getattr(trl_ppo, name)))
        return stack

    def _get_reward(self, trl_function):
        def get_reward(model, query_responses, pad_token_id, context_length):
            if model is self.reward_model:  # not the value model, which reads every position of the rollout
                query_responses = with_turn_end(query_responses, context_length, self.processing_class.eos_token_id,
                                                pad_token_id, self._turn_end)
            return trl_function(model, query_responses, pad_token_id, context_length)
        return get_reward

    def _batch_generation(self, trl_function):
        def batch_generation(model, queries, forward_batch_size, pad_token_id, generation_config):
            vocabulary = model.get_output_embeddings().weight.shape[0]  # its weight: peft may wrap the layer
            # trained token rows merged (snaketrl.train.generation.merge_rows_for_generation: the same logits)
            with merged(model, rows_only=True):
                if not chunks.exceeds_chunk(queries.shape[0] * generation_config.max_new_tokens, vocabulary):
                    return trl_function(model, queries, forward_batch_size, pad_token_id, generation_config)
                responses, logps = trl_function(_Scoring(model), queries, forward_batch_size, pad_token_id,
                                                generation_config)
            (logps._base if logps._base is not None else logps).snaketrl_logps = True
            return responses, logps
        return batch_generation

    def _forward(self, trl_function):
        def forward(model, query_responses, pad_token_id):
            inner = self.accelerator.unwrap_model(model)
            policy = inner.policy if isinstance(inner, trl_ppo.PolicyAndValueWrapper) else inner
            head = policy.get_output_embeddings() if chunks.supported(policy) else None
            if head is None or not chunks.exceeds_chunk(query_responses.numel(), vocabulary(head)):
                return trl_function(model, query_responses, pad_token_id)
            with chunks.without_projection(head) as autocast:
                out = trl_function(model, query_responses, pad_token_id)
            output = out[0] if isinstance(out, tuple) else out  # the policy's, beside the value model's scores
            stand_in = output.logits.new_zeros(*query_responses.shape, 1)
            stand_in.snaketrl_hidden = _Hidden(output.logits, head, autocast[0])
            output.logits = stand_in
            return out
        return forward

    def _selective_log_softmax(self, trl_function):
        def selective_log_softmax(logits, index):
            root = logits._base if logits._base is not None else logits
            if getattr(root, "snaketrl_logps", False):  # the generation's: each step's drawn token's log-prob
                return logits.squeeze(-1)
            hidden = getattr(root, "snaketrl_hidden", None)
            if hidden is None:
                return trl_function(logits, index)
            trained = torch.is_grad_enabled() and hidden.hidden.requires_grad
            return hidden.logps(logits, index, self.args.temperature + 1e-7, self._entropies if trained else None)
        return selective_log_softmax

    def _autocast(self):
        """bf16 autocast for everything TRL's loop runs. Other trainers get it from transformers' Trainer (its
        Accelerator is built with the config's mixed precision); TRL's PPOTrainer builds its own Accelerator
        without one, so generation, the reference/value/reward passes and the update run in the weights' own
        dtypes. A 4-bit policy has mixed ones: peft's prepare_model_for_kbit_training leaves its norms, embeddings
        and lm_head in fp32, then TRL's peft_module_casting_to_bf16 casts lm_head and the embeddings back to
        bf16 while keeping the norms fp32, so fp32 hidden states meet a bf16 lm_head.
        Without autocast's weight cache: it keeps each cast of a trained weight until the outermost region exits,
        and this one spans the whole loop, so every forward would read the adapter as it was at the first
        (tests/test_train.py: the rollouts of any learning rate were those of the untrained policy)."""
        if self.args.bf16:
            return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def generate_completions(self, sampling: bool = False):
        if sampling and (self.state.global_step - 1) % self._sample_every:
            return None
        with self._autocast(), self._patched():
            return super().generate_completions(sampling=sampling)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "eps" in logs:  # TRL divides all episodes by this session's time; a resumed run did fewer
            started, episode = self._session
            logs["eps"] = int((self.state.episode - episode) / (time.time() - started))
        if "policy/entropy_avg" in logs and self._entropies:  # TRL's came from the stand-ins: each 0
            logs["policy/entropy_avg"] = self.accelerator.gather_for_metrics(torch.stack(self._entropies)).mean().item()
        self._entropies.clear()
        super().log(logs, start_time)
        if self.control.should_training_stop and self._training:
            raise _Stop  # TRL's loop never reads should_training_stop (snaketrl.train.guard sets it)

    def _gathered(self, prefix: str) -> dict:
        """The wrapped model's weights under `prefix` (policy. or value_model.), whole and as plain copies: DeepSpeed
        keeps them as views into its flat buffers (ZeRO-2), which safetensors refuses to save, or sharded (ZeRO-3,
        gathered here: every rank calls this)."""
        state = self.accelerator.get_state_dict(self.model)
        return {k[len(prefix):]: v.detach().clone().contiguous() for k, v in (state or {}).items()
                if k.startswith(prefix)}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The policy's adapter. TRL's own save under DeepSpeed hands transformers the policy where it expects
        DeepSpeed's engine (it reads the engine's config), and fails; the other cases are TRL's."""
        if not self.is_deepspeed_enabled:
            return super().save_model(output_dir, _internal_call)
        policy = self._gathered("policy.")
        if self.args.should_save:
            self.accelerator.unwrap_model(self.model).policy.save_pretrained(output_dir or self.args.output_dir,
                                                                             state_dict=policy)
        return None

    def _save_checkpoint(self, model, trial) -> None:
        out = Path(self._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        out.mkdir(parents=True, exist_ok=True)
        if self.is_deepspeed_enabled:
            from safetensors.torch import save_file

            value = self._gathered("value_model.")
            if self.args.should_save:
                save_file(value, str(out / VALUE_MODEL))
        elif self.args.should_save:
            from safetensors.torch import save_model

            save_model(self.accelerator.unwrap_model(self.model).value_model, str(out / VALUE_MODEL))
        torch.save(self._passes.state_dict(), out / data_state_name(self.args.process_index))
        super()._save_checkpoint(model, trial)  # trainer_state.json last: a checkpoint with it is whole

    def _load_checkpoint(self, checkpoint: str) -> dict:
        from safetensors.torch import load_model

        path = Path(checkpoint)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise SnaketrlError(f"PPO resumes without DeepSpeed or FSDP only (their optimizer state is saved "
                                f"another way); delete {path} to start over")
        needed = [VALUE_MODEL, data_state_name(self.args.process_index), OPTIMIZER_NAME, SCHEDULER_NAME,
                  TRAINER_STATE_NAME]
        missing = [name for name in needed if not (path / name).is_file()]
        if missing:
            raise DataError(f"PPO checkpoint {path} lacks {', '.join(missing)} (written by another version or "
                            f"cut short); delete it to start over")
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._load_from_checkpoint(checkpoint, model=unwrapped.policy)  # loads into the live parameters
        load_model(unwrapped.value_model, str(path / VALUE_MODEL), device=str(self.accelerator.device))
        # Trainer._load_optimizer_and_scheduler reads attributes TRL's PPOTrainer never sets.
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_NAME, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(path / SCHEDULER_NAME, weights_only=True))
        self._passes.load_state_dict(torch.load(path / data_state_name(self.args.process_index), weights_only=True))
        return json.loads((path / TRAINER_STATE_NAME).read_text())

    def train(self, resume_from_checkpoint: str | None = None) -> TrainOutput:
        started = time.perf_counter()
        total = self.args.num_total_batches
        added, episode = [], 0
        if resume_from_checkpoint:
            saved = self._load_checkpoint(resume_from_checkpoint)
            # The loop runs range(1, num_total_batches + 1): the updates left. Its `update` index is only
            # read by the sampling period, which generate_completions takes from the global step.
            self.args.num_total_batches = total - saved["global_step"]
            added = [_Resume(self, resume_from_checkpoint, saved, total)]
            self.callback_handler.callbacks.insert(0, added[0])
            if self.args.num_sample_generations > 0:
                added.append(_ReplaySampling(self))
                self.callback_handler.callbacks.append(added[-1])
            episode = saved["episode"]
        self._session = (time.time(), episode)  # for `eps`
        loader, self.dataloader = self.dataloader, self._passes  # TRL's loop reads self.dataloader once
        # TRL's loop logs before its step end: a stop decided there before the last update (a budget,
        # snaketrl.train.tokens, which also turns that step's save off) ends the loop right after the callbacks
        # heard it, before another update. The last update ends as TRL ends it (its save, its samples).
        step_end = self.callback_handler.on_step_end

        def on_step_end(args, state, control):
            control = step_end(args, state, control)
            if control.should_training_stop and state.global_step < state.max_steps:
                raise _Stop
            return control

        self.callback_handler.on_step_end = on_step_end
        # TRL runs gc.collect() twice an update; each rescans every object alive now (modules, models),
        # which outlive training anyway: seconds per update on a tiny model, none once they are frozen.
        gc.freeze()
        self._training = True
        try:
            with self._autocast(), self._patched():
                super().train()
        except _Stop:  # left at the log or step end, before another update; the callbacks still hear the end
            self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        finally:
            self._training = False
            gc.unfreeze()
            self.dataloader = loader
            del self.callback_handler.on_step_end
            self.args.num_total_batches = total
            for callback in added:
                self.callback_handler.callbacks.remove(callback)
        metrics = {"train_runtime": time.perf_counter() - started, "global_step": self.state.global_step}
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        return TrainOutput(self.state.global_step, None, metrics)


def bound_logits(trainer: PPOTrainer) -> None:
    """`trainer` (its weights whole in each process: not under FSDP or ZeRO-3, whose hooks gather them) bounds its
    logits as the module docstring says, where a batch's exceed a chunk."""
    trainer._bounded = True


def score_to_turn_end(trainer: PPOTrainer) -> None:
    """`trainer`'s reward model reads each completion that ended with eos to the end of its chat turn, as the module
    docstring says: for a run whose prompts are chat turns."""
    trainer._turn_end = turn_end(trainer.processing_class)
