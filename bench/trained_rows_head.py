"""CPU seconds of GRPO's trained pass (snaketrl.train.logps, forward and backward) with a head that trains a chat
template's two added rows (peft's trainable tokens), and how many times that head's whole weight is built.

A Qwen2-shaped model 64 wide (2 layers, tied embeddings) with Gemma 3's 262,144-entry vocabulary plus two added
tokens, random weights, fp32, one thread: its layers cost next to nothing, so the pass's time is the vocabulary's.
Run it against two checkouts to compare (PYTHONPATH picks the snaketrl that is imported):

    PYTHONPATH=. python bench/trained_rows_head.py --rows 8 --completion 64 --repeats 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
import types
from types import SimpleNamespace

VOCAB = 262144
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": True}


def model_with_trained_rows():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketrl.models.chat_template import trainable_tokens, write_record

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", vocab_size=VOCAB, **SHAPE))
    model.resize_token_embeddings(VOCAB + 2, mean_resizing=False)
    with tempfile.TemporaryDirectory() as record:
        write_record({"added_tokens": {"<|im_start|>": VOCAB, "<|im_end|>": VOCAB + 1}}, record)
        lora = trainable_tokens(model, record, {"r": 8, "target_modules": ["q_proj", "v_proj"]})
    return get_peft_model(model, LoraConfig(**lora))


def grpo_pass(model):
    """TRL's GRPO log-prob method on `model`, chunked as build_trainer chunks it (what it reads of its trainer)."""
    import trl

    from snaketrl.train.logps import chunk_completion_logits

    trainer = SimpleNamespace(temperature=1.0, _entropy_bonus_enabled=False,
                              model_kwarg_keys=inspect.signature(model.get_base_model().forward).parameters.keys(),
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True))
    trainer._get_per_token_logps_and_entropies = types.MethodType(
        trl.GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    chunk_completion_logits(trainer)
    return trainer._get_per_token_logps_and_entropies


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    torch.set_num_threads(1)
    model = model_with_trained_rows()
    logps = grpo_pass(model)
    builds, build = [], TrainableTokensLayer.get_merged_weights
    TrainableTokensLayer.get_merged_weights = lambda layer, active: builds.append(layer) or build(layer, active)
    head = model.get_output_embeddings().token_adapter
    ids = torch.randint(0, VOCAB + 2, (args.rows, args.prompt + args.completion),
                        generator=torch.Generator().manual_seed(1))
    seconds, head_builds = [], []
    for _ in range(args.repeats + 1):  # the first: warm-up
        builds.clear()
        model.zero_grad()
        start = time.process_time()
        lp, _, _ = logps(model, ids, torch.ones_like(ids), args.completion)
        lp.sum().backward()
        seconds.append(time.process_time() - start)
        head_builds.append(sum(b is head for b in builds))
    start = time.process_time()
    for _ in range(5):
        build(head, head.active_adapters)
    one_build = (time.process_time() - start) / 5
    print(json.dumps({"rows": args.rows, "completion": args.completion, "cpu_s": [round(s, 3) for s in seconds[1:]],
                      "median_cpu_s": round(statistics.median(seconds[1:]), 3), "head_builds": head_builds[1:],
                      "one_build_cpu_s": round(one_build, 4)}))


if __name__ == "__main__":
    main()
