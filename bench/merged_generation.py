"""One GRPO generation batch, LoRA merged (snaketrl.train.generation) against TRL's unmerged path, on this CPU.

    PYTHONPATH=. python bench/merged_generation.py MODEL_DIR [--threads 1] [--repeats 3]

TRL's own `_generate_single_turn` of a built GRPOTrainer (the policy in training mode, as TRL samples): 4 arithmetic
prompts x 4 generations = 16 completions of at most 64 new tokens, temperature 0.7, LoRA r16 on q/k/v/o (the
config/smollm2.yaml settings) with a non-zero adapter. Merged and unmerged alternate, the same seed each: the
medians (wall and CPU seconds), the tokens each made, whether they are the same, and the merge+restore time alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def grpo_trainer(model_dir, tmp):
    """A GRPO trainer on `model_dir` with LoRA r16 on q/k/v/o and its adapter's B set non-zero."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=64, temperature=0.7, report_to="none", use_cpu=True,
                      activation_checkpointing=False, seed=0)
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, peft_config=lora,
                          reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          train_dataset=Dataset.from_list([{"prompt": "1+1?"}] * 16))
    torch.manual_seed(1)
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)  # a trained adapter's: zero B would leave the merge a no-op
    return trainer, tokenizer


def prompts(tokenizer, n: int = 4, generations: int = 4) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "data/samples/arithmetic.jsonl").read_text().splitlines()[:n]]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for r in rows]
    return [list(p) for p in ids for _ in range(generations)]


def main() -> None:
    import torch
    from transformers import set_seed

    from snaketrl.train.generation import merged

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    trainer, tokenizer = grpo_trainer(opts.model_dir, tempfile.mkdtemp())
    trainer.model.train()
    batch = prompts(tokenizer)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)

    def generate(merge: bool):
        set_seed(0)
        started, cpu = time.perf_counter(), time.process_time()
        with merged(model) if merge else contextlib.nullcontext():
            ids, _ = trainer._generate_single_turn(batch, None, {})
        return time.perf_counter() - started, time.process_time() - cpu, ids

    generate(False)  # warm-up: first-call allocations and oneDNN's kernel choice
    times, cpu, outputs = {False: [], True: []}, {False: [], True: []}, {}
    for _ in range(opts.repeats):
        for merge in (False, True):
            seconds, cpu_seconds, outputs[merge] = generate(merge)
            times[merge].append(seconds)
            cpu[merge].append(cpu_seconds)
    overhead = []
    for _ in range(5):
        started = time.perf_counter()
        with merged(model):
            pass
        overhead.append(time.perf_counter() - started)
    same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    print(json.dumps({
        "threads": opts.threads,
        "unmerged_s": [round(t, 3) for t in times[False]], "merged_s": [round(t, 3) for t in times[True]],
        "unmerged_median_s": round(statistics.median(times[False]), 3),
        "merged_median_s": round(statistics.median(times[True]), 3),
        "speedup": round(statistics.median(times[False]) / statistics.median(times[True]), 3),
        # CPU seconds: what other processes' load on the cores disturbs least
        "unmerged_cpu_s": [round(t, 3) for t in cpu[False]], "merged_cpu_s": [round(t, 3) for t in cpu[True]],
        "cpu_speedup": round(statistics.median(cpu[False]) / statistics.median(cpu[True]), 3),
        "merge_restore_median_s": round(statistics.median(overhead), 4),
        "tokens_unmerged": sum(map(len, outputs[False])), "tokens_merged": sum(map(len, outputs[True])),
        "identical_completions": f"{same}/{len(batch)}"}, indent=1))


if __name__ == "__main__":
    main()
