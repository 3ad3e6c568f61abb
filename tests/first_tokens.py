"""What a model sees first: the token ids of a trainer's first forward pass through train_run, and of the first
prompt an evaluation generates from. Shared by the fast chat tests (a tiny model with a ChatML template) and the
`real` tier (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
from pathlib import Path

from snaketrl.config import resolve_runs
from snaketrl.io import read_jsonl, write_json, write_jsonl
from snaketrl.trainers import REGISTRY

# Rows as preprocessing leaves them: plain text (an HH transcript for DPO), so the chat conversion shows.
ROWS = {
    "sft": {"prompt": "TITLE: Lost keys\n\nPOST: I lost my keys again.\n\nTL;DR:", "completion": " I lost my keys."},
    "dpo": {"prompt": "\n\nHuman: What is 2+2?\n\nAssistant: Four.\n\nHuman: And 3+3?\n\nAssistant:",
            "chosen": " Six.", "rejected": " Seven."},
    "reward": {"prompt": "She walked into the room and saw a", "chosen": " misty, delicate window.",
               "rejected": " window."},
    "grpo": {"prompt": "Sam has 3 apples and gets 4 more. How many apples does Sam have now?",
             "answer": "Sam has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    "ppo": {"prompt": "Through the window they noticed a"},
}
# KTO and ORPO read DPO's pair (KTO as its two unpaired rows), RLOO GRPO's prompt.
ROWS.update(kto=ROWS["dpo"], orpo=ROWS["dpo"], rloo=ROWS["grpo"])
# A step or two of each, on that one row.
ARGS = {
    "sft": {"per_device_train_batch_size": 1},
    "dpo": {"per_device_train_batch_size": 1},
    "reward": {"per_device_train_batch_size": 1},
    "grpo": {"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 4},
    "ppo": {"per_device_train_batch_size": 1, "local_rollout_forward_batch_size": 1, "response_length": 4,
            "num_ppo_epochs": 1, "num_mini_batches": 1, "num_sample_generations": 0, "stop_token": "eos"},
    "kto": {"per_device_train_batch_size": 2},
    "orpo": {"per_device_train_batch_size": 1},
    "rloo": {"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 4},
}
DATASETS = {"sft": "tldr", "dpo": "hh", "reward": "descriptiveness", "grpo": "arithmetic", "ppo": "descriptiveness",
            "kto": "hh", "orpo": "hh", "rloo": "arithmetic"}


def first_forward():
    """A callback recording the input ids of the first forward pass of the model being trained (generation's
    prefill for GRPO and PPO, the policy's or reference's pass for the others): what the model reads. Built
    when needed: transformers' Trainer is 8 s of imports at collection time on every pytest worker."""
    from transformers import TrainerCallback

    class FirstForward(TrainerCallback):
        def __init__(self):
            self.ids = None
            self.packed = None  # a padding-free forward's position_ids (no attention mask), whose 0s start sequences
            self._hooks = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from snaketrl.train.cost import decoder
            from snaketrl.train.tokens import _embeddings

            def first(module, inputs):
                if self.ids is None:
                    self.ids = inputs[0].tolist()

            def positions(module, args, kwargs):
                if self.ids is None and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None:
                    self.packed = kwargs["position_ids"].tolist()

            self._hooks = [decoder(model).register_forward_pre_hook(positions, with_kwargs=True),
                           _embeddings(model).register_forward_pre_hook(first)]

        def on_train_end(self, args, state, control, **kwargs):
            for hook in self._hooks:
                hook.remove()

        def sequences(self) -> list[list[int]]:
            """The first forward's sequences: its rows, and a padding-free row cut where its positions restart
            (on CUDA the varlen kernel reads a pair's two sequences as one row)."""
            if self.packed is None:
                return self.ids
            starts = [[i for i, p in enumerate(row) if p == 0] + [len(row)] for row in self.packed]
            return [row[a:b] for row, cuts in zip(self.ids, starts) for a, b in zip(cuts, cuts[1:])]

    return FirstForward()


def config_for(model_name: str, model_entry: dict, trainer: str, steps: int) -> dict:
    """A config of one run of `trainer` on `model_entry` (every other key as the schema fills it)."""
    from snakemake.utils import validate

    from conftest import ROOT

    dataset = DATASETS[trainer]
    config = {
        "models": {model_name: model_entry},
        "datasets": {dataset: {"files": "workflow:data/samples/tldr.jsonl"}},
        # The trainer's own fields under its args: `training` applies to every trainer (PPO's rm run too).
        "trainers": {trainer: {"dataset": dataset, "args": dict(ARGS[trainer]),
                               **({"reward_funcs": ["accuracy"]} if REGISTRY[trainer].reward_funcs else {}),
                               **({"reward_model": "rm"} if trainer == "ppo" else {})},
                     **({"reward": {"dataset": dataset}} if trainer == "ppo" else {})},
        "training": {"max_steps": steps, "eval_strategy": "no", "save_strategy": "no", "logging_steps": 1,
                     "report_to": "none"},
        "runs": {"run": {"trainer": trainer, "model": model_name},
                 **({"rm": {"trainer": "reward", "model": model_name}} if trainer == "ppo" else {})},
    }
    if trainer == "ppo":  # PPO counts episodes, not steps
        config["trainers"]["ppo"]["args"]["total_episodes"] = steps
        del config["training"]["max_steps"]
    validate(config, str(ROOT / "config" / "schema.yaml"))
    return config


def first_training_ids(trainer: str, model_name: str, model_entry: dict, model_dir, work: Path, *,
                       reward_dir=None, steps: int = 1, chat: bool = True, threads: int | None = None):
    """train_run of one `trainer` run on its one row (ROWS) for `steps` steps, with prompts as chat turns where
    `chat`: returns the first forward's rows (pad tokens removed) and the tokenizer the run trained with."""
    from transformers import AutoTokenizer

    from snaketrl.data.lengths import tokenize_prompt_files
    from snaketrl.models.tokenizer import prepare_tokenizer
    from snaketrl.train.run import train_run

    run = resolve_runs(config_for(model_name, model_entry, trainer, steps))["run"]
    assert run.get("chat", False) is chat
    work.mkdir(parents=True, exist_ok=True)
    rows = [ROWS[trainer]]
    write_json({"max_length": 256, "chat": chat}, work / "lengths.json")
    for split in ("train", "eval"):
        write_jsonl(rows, work / f"{split}.jsonl")
    if REGISTRY[trainer].tokenized:  # PPO reads token ids, made as the tokenize_prompts job makes them
        tokenize_prompt_files(model_dir, work / "lengths.json",
                              {s: (work / f"{s}.jsonl", work / f"{s}.ids.jsonl") for s in ("train", "eval")})
    suffix = ".ids.jsonl" if REGISTRY[trainer].tokenized else ".jsonl"
    seen = first_forward()
    train_run(run, model_dir=model_dir, train_file=work / f"train{suffix}", eval_file=work / f"eval{suffix}",
              lengths_file=work / "lengths.json", out_dir=work / "out", checkpoint_dir=work / "ckpt",
              reward_dir=reward_dir, callbacks=[seen], threads=threads)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    return [[t for t in row if t != tokenizer.pad_token_id] for row in seen.sequences()], tokenizer


def trained_rows(trainer: str, model_name: str, model_entry: dict, model_dir, work: Path, expected: list[str], *,
                 reward_dir=None) -> list[list[int]]:
    """The first forward's rows of two steps of `trainer` (first_training_ids; `reward_dir` for PPO), checked to be
    the `expected` texts: decoded, and as the tokenizer writes them."""
    ids, tokenizer = first_training_ids(trainer, model_name, model_entry, model_dir, work, steps=2,
                                        reward_dir=reward_dir if trainer == "ppo" else None)
    assert [decoded(tokenizer, row) for row in ids] == expected
    assert ids == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in expected]
    return ids


def first_eval_prompt_ids(model_name: str, model_dir, work: Path, monkeypatch, *, chat: bool = True) -> list[int]:
    """The token ids of the first prompt the evaluate job generates from (the arithmetic sample's first eval row
    as a chat, where `chat`), through snaketrl.evaluate.job.evaluate."""
    import snaketrl.evaluate.job as job
    from snaketrl.config.evaluation import _with_defaults

    seen = {}
    generate = job.generate

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        seen.setdefault("ids", out.prompt_ids[0])
        return out

    monkeypatch.setattr(job, "generate", spy)
    settings = _with_defaults({"prompts": {"dataset": "arithmetic", "size": 1}, "generation": {"max_new_tokens": 2}})
    work.mkdir(parents=True, exist_ok=True)
    write_jsonl([ROWS["grpo"]], work / "prompts.jsonl")
    target = {"kind": "base", "run": None, "model": model_name, "trainer": "base", "seed": 1, "reference": None,
              **({"chat": ["prompts"]} if chat else {})}
    job.evaluate(target=target, settings=settings, model_dir=model_dir, prompts_file=work / "prompts.jsonl",
                 out_completions=work / "completions.jsonl", out_metrics=work / "metrics.json")
    assert [r["prompt"] for r in read_jsonl(work / "completions.jsonl")] == (
        [[{"role": "user", "content": ROWS["grpo"]["prompt"]}]] if chat else [ROWS["grpo"]["prompt"]])
    return seen["ids"]


def decoded(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def read_manifest(work: Path) -> dict:
    return json.loads((work / "out" / "manifest.json").read_text())


def check_trained_two_steps(work: Path, sha256: str, quant_type: str) -> None:
    """A tier's run in `work`: chat prompts, the GGUF it was converted from (hash and quantization), 2 steps."""
    manifest = read_manifest(work)
    assert manifest["config"]["chat"] is True
    assert manifest["model_source"]["sha256"] == sha256 and manifest["model_source"]["quant_type"] == quant_type
    assert json.loads((work / "out" / "trainer_state.json").read_text())["global_step"] == 2


CHATML_ASK = "<|im_start|>assistant\n"


def chatml_first_rows(turns) -> dict[str, list[str]]:
    """Each trainer's first rows as text, for a model given ChatML turns (`turns(*texts)`: its template's rendering,
    system turn and bos included): the rows `trained_rows` feeds, as its first forward pass must see them."""
    hh = ("What is 2+2?", "Four.", "And 3+3?")
    question = turns("Sam has 3 apples and gets 4 more. How many apples does Sam have now?") + CHATML_ASK
    return {
        "sft": [turns("TITLE: Lost keys\n\nPOST: I lost my keys again.\n\nTL;DR:", "I lost my keys.")],
        "dpo": [turns(*hh, "Six."), turns(*hh, "Seven.")],
        "kto": [turns(*hh, "Seven."), turns(*hh, "Six.")],  # TRL's unpaired rows, its KL pairing first
        # TRL's experimental ORPO appends eos to each completion, after the template's own <|im_end|>\n
        "orpo": [turns(*hh, "Six.") + "<|im_end|>", turns(*hh, "Seven.") + "<|im_end|>"],
        "reward": [turns("She walked into the room and saw a", "misty, delicate window."),
                   turns("She walked into the room and saw a", "window.")],
        # once for its 2 generations: the plan prefills each distinct prompt once (snaketrl.train.prefill)
        "grpo": [question],
        "rloo": [question],
        "ppo": [turns("Through the window they noticed a") + CHATML_ASK],
    }
