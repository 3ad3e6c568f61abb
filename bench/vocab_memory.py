"""Each trainer's peak memory on a tiny model with Gemma 3's 262,144-token vocabulary, against the estimate.

A Qwen2-shaped model (hidden 64, 2 layers, tied embeddings) with a 262,144-entry vocabulary, random weights, the
tiny models' tokenizer (its 1,024 ids; decoding skips the rest): its layers cost next to nothing, so what a
training step adds to memory is the vocabulary's logits. Each trainer trains through snaketrl's train_run as a
real model would (not as a tiny one: the one-pass SFT loss and DPO's completion logits apply), in a process of
its own; its peak resident memory during training (the kernel's VmHWM, reset when training begins) above the
resident memory then is set against snaketrl.train.memory's estimate for the plan's tokens per forward; so is the
last step's alone (VmHWM reset again when it begins), without the first step's one-time allocations (on a CPU
about 0.14 GiB at this vocabulary: oneDNN's and the allocator's, whatever the batch). A watchdog ends a process
above --limit-gb. --hh trains the preference trainers on hh-rlhf's long pairs; --trl-logits keeps TRL's logits.

    python bench/vocab_memory.py --trainers sft dpo grpo ppo --rows 4 --length 128
    python bench/vocab_memory.py --trainers dpo kto orpo --rows 2 --length 256 --hh [--trl-logits]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 262144
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": True}
DATA = {"language_modeling": "tldr", "preference": "descriptiveness", "prompt": "tldr"}
# --hh: the preference trainers' pairs from hh-rlhf (harmless-base), whose completions run to hundreds of tokens
HH = ROOT.parent / "shared/data/hh-rlhf-harmless-base/train.jsonl"


def build(out: Path) -> Path:
    """The large-vocabulary model and its SEQ_CLS copy (PPO's reward and value models), once."""
    if (out / "policy" / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from snaketrl.data.samples import GENERATORS
    from snaketrl.models.tiny import corpus_texts, train_tokenizer

    tokenizer = train_tokenizer(corpus_texts(sorted(ROOT / "data/samples" / f"{name}.jsonl" for name in GENERATORS)),
                                1024)
    tokenizer.model_max_length = SHAPE["max_position_embeddings"]
    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    AutoModelForSequenceClassification.from_pretrained(out / "policy", num_labels=1).save_pretrained(out / "reward")
    tokenizer.save_pretrained(out / "reward")
    return out


def status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def watchdog(limit: int) -> None:
    def watch():
        while True:
            if status("VmRSS") > limit:
                print(f"watchdog: above {limit / 2 ** 30:.1f} GiB resident, stopping", file=sys.stderr, flush=True)
                os._exit(3)
            threading.Event().wait(0.02)

    threading.Thread(target=watch, daemon=True).start()


def one(trainer: str, rows: int, length: int, completion: int, policy: Path, reward: Path, tmp: Path,
        args: dict, hh: bool = False) -> dict:
    """Train `trainer` a few steps in this process; its peak above the resident memory at the start of training."""
    import yaml
    from transformers import AutoTokenizer, TrainerCallback

    from snaketrl.config import resolve_runs
    from snaketrl.models.chat_template import trains_added_rows
    from snaketrl.data.lengths import tokenize_prompts
    from snaketrl.data.preprocess import preprocess
    from snaketrl.io import read_jsonl, write_jsonl
    from snaketrl.train import logps
    from snaketrl.train.memory import activation_bytes
    from snaketrl.train.plan import forward_tokens, projected_tokens
    from snaketrl.train.run import train_run
    from snaketrl.train.scored import TRAINERS
    from snaketrl.trainers import REGISTRY

    os.chdir(ROOT)
    spec = REGISTRY[trainer]
    dataset = DATA[spec.layout]
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["training"].update(max_steps=2, logging_steps=1, eval_strategy="no", save_steps=100,
                              per_device_train_batch_size=rows, per_device_eval_batch_size=rows,
                              activation_checkpointing=False)
    per = {"grpo": {"num_generations": 2, "max_completion_length": completion},
           "rloo": {"num_generations": 2, "max_completion_length": completion},
           "online_dpo": {"max_new_tokens": completion},
           "ppo": {"total_episodes": 2 * rows, "local_rollout_forward_batch_size": rows,
                   "response_length": completion, "num_sample_generations": 0, "num_ppo_epochs": 1,
                   "stop_token": "eos"}}
    config["trainers"].setdefault(trainer, {"dataset": dataset})
    config["trainers"][trainer].update(args=copy.deepcopy({**per.get(trainer, {}), **args}), policy=None)
    if spec.reward_funcs:
        config["trainers"][trainer]["reward_funcs"] = ["unique_chars"]
    config["runs"] = {f"m-{trainer}": {"trainer": trainer, "model": "qwen2-tiny", "dataset": dataset},
                      "reward-qwen2-tiny": {"trainer": "reward", "model": "qwen2-tiny"}}
    config["matrix"] = {"trainers": [], "models": []}
    run = resolve_runs(config)[f"m-{trainer}"]
    run["model_entry"] = {k: v for k, v in run["model_entry"].items() if k != "tiny"}  # trained as a real model
    tokenizer = AutoTokenizer.from_pretrained(policy)
    hh = hh and spec.layout == "preference"
    data = preprocess(read_jsonl(HH if hh else ROOT / f"data/samples/{dataset}.jsonl")[:8 * rows + 8],
                      dataset=dataset, trainer=trainer, layout=spec.layout, columns={}, split="train",
                      format="hh" if hh else None, bad_rows="drop" if hh else "error").rows
    (tmp / "lengths.json").write_text(json.dumps({"max_length": length}))
    if spec.tokenized:
        data = tokenize_prompts(data, tokenizer, length)
    write_jsonl(data[:-4], tmp / "train.jsonl")
    write_jsonl(data[-4:], tmp / "eval.jsonl")

    start = {}

    widest, step, begun = [0], [0], [0]

    def count(module, args):  # the policy's training forwards in a step (row groups: several), as estimated
        import torch

        if torch.is_grad_enabled() and args and torch.is_tensor(args[0]):
            step[0] += args[0].numel()
            widest[0] = max(widest[0], step[0])

    class Peak(TrainerCallback):
        def on_train_begin(self, *a, model=None, **k):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the resident memory now
            start["rss"] = status("VmRSS")
            model = getattr(model, "policy", model)  # PPO's wrapper
            model.get_input_embeddings().register_forward_pre_hook(count)

        def last_step(self):  # the last step alone, without the first one's one-time allocations
            step[0] = 0
            start["first_peak"] = status("VmHWM")
            Path("/proc/self/clear_refs").write_text("5")
            start["last"] = status("VmRSS")

        def on_step_begin(self, *a, **k):
            step[0] = 0
            begun[0] += 1
            if begun[0] == 2:
                self.last_step()

        def on_step_end(self, args, state, *a, **k):
            if trainer == "ppo" and state.global_step == 1:  # PPO's own loop calls no on_step_begin
                self.last_step()

    metrics = train_run(run, model_dir=policy, train_file=tmp / "train.jsonl",
                        eval_file=tmp / "eval.jsonl", lengths_file=tmp / "lengths.json", out_dir=tmp / "out",
                        checkpoint_dir=tmp / "ckpt", reward_dir=reward if spec.value_model else None,
                        callbacks=[Peak()])
    peak = status("VmHWM")
    from types import SimpleNamespace

    fields = SimpleNamespace(per_device_train_batch_size=rows, max_completion_length=completion,
                             response_length=completion if trainer == "ppo" else None)
    tokens = forward_tokens(spec, fields, length)
    shape = json.loads((policy / "config.json").read_text())
    from snaketrl.train.args import native_bf16

    size = 2 if native_bf16(cpu=True) else 4  # the plan trains a real model in bf16 where the CPU computes it
    projected = projected_tokens(trainer, spec, fields, length)
    upcast = trainer == "sft"
    # as the plan counts them (not under --trl-logits)
    rows = trains_added_rows(policy, run["lora"])
    # DPO's, KTO's and ORPO's chunks decline a head whose added tokens' rows train (scored.plans_chunks)
    chunked = ((trainer in TRAINERS and not rows) or trainer in logps.TRAINERS or spec.value_model) \
        and logps.CHUNK_BYTES < 2 ** 62
    value, kept = spec.value_model, trainer in logps.TRAINERS
    # positions in proportion to the step's tokens (GRPO's and RLOO's completions run to their cap whatever the
    # prompts); KTO's KL forward runs without gradient and is left out of the step's tokens
    trained = projected if kept else widest[0] * projected // tokens
    return {"trainer": trainer, "tokens": tokens,
            "estimate": activation_bytes(shape, tokens, size, projected, upcast, chunked, value, kept, rows),
            "trained_tokens": widest[0],
            "estimate_trained": activation_bytes(shape, widest[0], size, trained, upcast, chunked, value, kept, rows),
            "estimate_before": activation_bytes(shape, widest[0], size),
            "start_rss": start["rss"], "peak": max(peak, start.get("first_peak", 0)),
            "added": max(peak, start.get("first_peak", 0)) - start["rss"],
            "added_last": peak - start["last"] if "last" in start else None,
            "labelled": metrics.get("logits_on_labels_only")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", nargs="*", default=["sft", "dpo", "reward", "grpo", "rloo", "ppo", "kto", "orpo"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--limit-gb", type=float, default=8.0)
    ap.add_argument("--work", default="/tmp/vocab_memory")
    ap.add_argument("--model", help="a model directory to measure instead (PPO: with --reward)")
    ap.add_argument("--reward", help="--model's SEQ_CLS copy, PPO's reward and value model")
    ap.add_argument("--trl-logits", action="store_true",
                    help="GRPO's, RLOO's, DPO's, KTO's and ORPO's logits unchunked, as TRL has them")
    ap.add_argument("--hh", action="store_true", help="the preference trainers' pairs from hh-rlhf, not the sample")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    work = Path(opts.work)
    if opts.one:
        watchdog(int(opts.limit_gb * 2 ** 30))
        if opts.trl_logits:
            from snaketrl.train import logps

            logps.CHUNK_BYTES = 2 ** 62
        import tempfile

        with tempfile.TemporaryDirectory(dir=work) as tmp:
            result = one(opts.one, opts.rows, opts.length, opts.completion, Path(opts.model) if opts.model else
                         work / "models" / "policy", Path(opts.reward) if opts.reward else work / "models" / "reward",
                         Path(tmp), {}, opts.hh)
        print("RESULT " + json.dumps(result), flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    build(work / "models")
    gib = 2 ** 30
    print(f"{'trainer':8} {'tokens':>6} {'estimate GiB':>12} {'trained':>7} {'estimate GiB':>12} "
          f"{'measured GiB':>12} {'ratio':>6} {'last step':>9} {'ratio':>6}")
    for trainer in opts.trainers:
        proc = subprocess.run([sys.executable, __file__, "--one", trainer, "--rows", str(opts.rows), "--length",
                               str(opts.length), "--completion", str(opts.completion), "--limit-gb",
                               str(opts.limit_gb), "--work", str(work), *(["--trl-logits"] if opts.trl_logits else []),
                               *(["--hh"] if opts.hh else []),
                               *(["--model", opts.model] if opts.model else []),
                               *(["--reward", opts.reward] if opts.reward else [])], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{trainer:8} failed: {proc.stderr[-1500:]}")
            continue
        r = json.loads(line[7:])
        last, ratio = "-", "-"
        if r["added_last"] is not None:
            last, ratio = f"{r['added_last'] / gib:.3f}", f"{r['estimate_trained'] / max(r['added_last'], 1):.2f}"
        print(f"{trainer:8} {r['tokens']:6d} {r['estimate'] / gib:12.3f} {r['trained_tokens']:7d} "
              f"{r['estimate_trained'] / gib:12.3f} {r['added'] / gib:12.3f} "
              f"{r['estimate_trained'] / max(r['added'], 1):6.2f} {last:>9} {ratio:>6}"
              f"  (before: {r['estimate_before'] / gib:.3f} GiB, "
              f"{r['estimate_before'] / max(r['added'], 1):.2f}; peak {r['peak'] / gib:.2f}, labelled "
              f"{r['labelled']})", flush=True)


if __name__ == "__main__":
    main()
