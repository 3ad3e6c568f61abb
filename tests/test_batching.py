"""The batching the length stage chooses: exact (packing, grouping), checked at parse time, and estimated
as transformers batches."""

import json

import numpy as np
import pytest

from conftest import ROOT
from snaketrl.config import ConfigError, resolve_runs
from snaketrl.data.lengths import (PAIR_GROUPING, STRATEGY_ARGS, VARLEN_ATTENTION, batch_efficiency, choose_batching,
                                   length_stats, row_groups, sequence_lengths, split_efficiency)
from snaketrl.data.preprocess import preprocess
from snaketrl.io import read_jsonl


def _rows(name, trainer, layout, n):
    """The first n distinct examples (the samples repeat some, which would share a key below)."""
    rows = preprocess(read_jsonl(ROOT / f"data/samples/{name}.jsonl")[:4 * n], dataset=name, trainer=trainer,
                      layout=layout, columns={}, split="train").rows
    return list({json.dumps(r, sort_keys=True): r for r in rows}.values())[:n]


@pytest.fixture(scope="module")
def neox_model_dir(tiny_model_dir, tmp_path_factory):
    """A random GPT-NeoX (Pythia's architecture, partial rotary) sharing the tiny Qwen2's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model("gpt_neox", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                                  rotary_pct=0.25, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("neox")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _captured_forward(trainer, batch):
    """The model's inputs when the trainer computes its loss on `batch` (as in training; its first forward,
    the policy's), and the logits of those inputs (the trainer may compute its loss without them)."""
    import torch

    seen = {}
    model = trainer.model
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen or seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        try:
            trainer.compute_loss(model, trainer._prepare_inputs(batch))
        finally:
            hook.remove()
        seen["logits"] = model(**{k: v for k, v in seen.items() if k != "labels"}).logits
    return seen


def _token_losses(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")


def _sft_losses(model_dir, rows, tmp_path, strategy):
    """Mean loss of each example's completion tokens, keyed by its token ids, over every batch of an
    SFTTrainer using `strategy`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from snaketrl.train.args import build_args

    args = build_args("sft", {"per_device_train_batch_size": 4, "activation_checkpointing": False},
                      output_dir=str(tmp_path / strategy), max_length=128, seed=0, batching=STRATEGY_ARGS[strategy])
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir).eval(), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model_dir))
    losses, contaminated = {}, {}
    for batch in trainer.get_train_dataloader():
        seen = _captured_forward(trainer, batch)
        ids, labels, logits = seen["input_ids"], seen["labels"], seen["logits"]
        if strategy == "packed":
            assert ids.shape[0] == 1 and "attention_mask" not in seen  # padding-free: one flat sequence
            tokens = _token_losses(logits[0], labels[0])
            # The same flat sequence without position_ids: plain causal attention across neighbours.
            blind = _token_losses(trainer.model(input_ids=ids, use_cache=False).logits[0].detach(), labels[0])
            starts = (seen["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for s, e in zip(starts, starts[1:]):
                key, n = tuple(ids[0, s:e].tolist()), (labels[0, s + 1:e] != -100).sum()
                losses[key] = float(tokens[s:e - 1].sum() / n)
                contaminated[key] = float(blind[s:e - 1].sum() / n)
        else:
            for row in range(ids.shape[0]):
                keep = seen["attention_mask"][row].bool()
                n = (labels[row, 1:] != -100).sum()
                losses[tuple(ids[row][keep].tolist())] = float(_token_losses(logits[row], labels[row]).sum() / n)
    return losses, contaminated


@pytest.mark.parametrize("arch", ["qwen2", "gpt_neox"])
def test_packed_losses_equal_unpacked_per_example(arch, tiny_model_dir, neox_model_dir, tmp_path):
    model_dir = tiny_model_dir if arch == "qwen2" else neox_model_dir
    rows = _rows("tldr", "sft", "language_modeling", 12)
    padded, _ = _sft_losses(model_dir, rows, tmp_path, "padded")
    packed, contaminated = _sft_losses(model_dir, rows, tmp_path, "packed")
    assert len(padded) == 12 and packed.keys() == padded.keys()
    # Packing put several examples in one sequence, or nothing here would test their separation.
    assert sum(1 for key in packed if contaminated[key] != pytest.approx(packed[key], abs=1e-3)) >= 6
    for key, loss in padded.items():
        assert packed[key] == pytest.approx(loss, abs=1e-5)


def _dpo_logps(model_dir, rows, tmp_path, strategy):
    """Each pair's (chosen, rejected) log-probability of its completion, keyed by their token ids, and
    the tokens processed, over every batch of a DPOTrainer using `strategy`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer
    from trl.trainer.utils import selective_log_softmax

    from snaketrl.models.tokenizer import prepare_tokenizer
    from snaketrl.train.args import build_args
    from snaketrl.train.run import with_lengths
    from snaketrl.train.sampler import with_grouped_sampler

    batching = {**STRATEGY_ARGS[strategy], **(PAIR_GROUPING if strategy == "grouped" else {})}
    # Batches of 2: snaketrl's sampler (as training uses it) sorts all 16 pairs, then shuffles the batches.
    args = build_args("dpo", {"per_device_train_batch_size": 2, "activation_checkpointing": False},
                      output_dir=str(tmp_path / strategy), max_length=128, seed=0, batching=batching)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prepare_tokenizer(tok, model)
    data = Dataset.from_list(rows)
    if strategy == "grouped":
        data = with_lengths(data, tok, "preference", args.length_column_name)
    trainer = with_grouped_sampler(DPOTrainer)(model=model, args=args, train_dataset=data, processing_class=tok)
    logps, processed = {}, 0
    for batch in trainer.get_train_dataloader():
        seen = _captured_forward(trainer, batch)
        ids, mask = seen["input_ids"], seen["attention_mask"].bool()
        completion = batch["completion_mask"][:, 1:].to(torch.bool)
        per_token = selective_log_softmax(seen["logits"][:, :-1], ids[:, 1:]) * completion
        half = ids.shape[0] // 2
        for row in range(half):
            key = (tuple(ids[row][mask[row]].tolist()), tuple(ids[half + row][mask[half + row]].tolist()))
            logps[key] = (float(per_token[row].sum()), float(per_token[half + row].sum()))
        processed += ids.numel()
    return logps, processed


def test_grouped_batches_give_the_same_dpo_logps(tiny_model_dir, tmp_path):
    rows = _rows("ultrafeedback", "dpo", "preference", 16)
    random_logps, random_tokens = _dpo_logps(tiny_model_dir, rows, tmp_path, "padded")
    grouped_logps, grouped_tokens = _dpo_logps(tiny_model_dir, rows, tmp_path, "grouped")
    assert len(random_logps) == 16 and grouped_logps.keys() == random_logps.keys()
    assert grouped_tokens < random_tokens  # the grouped batches did pad less
    for key, (chosen, rejected) in random_logps.items():
        assert grouped_logps[key] == pytest.approx((chosen, rejected), abs=1e-4)


def _batch_trainer(trainer_name, model_dir, rows, tmp_path, device="cpu"):
    """An SFT, DPO or reward trainer on `rows` with TRL's default batches of 8, on a model without dropout, in
    fp32 on `device` (on CUDA too, so that a difference is a fault and not bf16's rounding)."""
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer

    from snaketrl.models.tokenizer import prepare_tokenizer
    from snaketrl.train.args import build_args
    from snaketrl.trainers import REGISTRY, load

    spec = REGISTRY[trainer_name]
    args = build_args(trainer_name, {"per_device_train_batch_size": 8, "activation_checkpointing": False,
                                     "bf16": False, "use_cpu": device == "cpu"},
                      output_dir=str(tmp_path / trainer_name), max_length=128, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"num_labels": 1} if spec.task_type == "SEQ_CLS" else {}
    model = getattr(transformers, spec.model_class).from_pretrained(model_dir, **kwargs).eval()
    prepare_tokenizer(tok, model)
    return load(spec.trainer)(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def _losses_and_grads(trainer, batches, items):
    """Each batch's loss and the gradient it gives every weight, and the tokens the model embedded; `items`:
    divide the loss by the batch's label tokens, as transformers' training step does (else their mean)."""
    model, embedded, out = trainer.model, [], []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, a: embedded.append(a[0].numel()))
    try:
        for batch in batches:
            model.zero_grad()
            n = (batch["labels"][:, 1:] != -100).sum() if items else None
            loss = trainer.compute_loss(model, trainer._prepare_inputs(dict(batch)), num_items_in_batch=n)
            loss.backward()
            out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    finally:
        hook.remove()
    return out, sum(embedded)


@pytest.mark.parametrize("trainer_name, dataset, layout, items, device", [
    ("sft", "tldr", "language_modeling", False, "cpu"), ("sft", "tldr", "language_modeling", True, "cpu"),
    ("dpo", "ultrafeedback", "preference", False, "cpu"), ("reward", "descriptiveness", "preference", False, "cpu"),
    # On CUDA sdpa without a mask takes another kernel than with one (a user's sdpa and grouped batches there)
    pytest.param("sft", "tldr", "language_modeling", True, "cuda", marks=pytest.mark.cuda),
    pytest.param("dpo", "ultrafeedback", "preference", False, "cuda", marks=pytest.mark.cuda)])
def test_row_groups_give_the_same_losses_and_gradients(trainer_name, dataset, layout, items, device, tiny_model_dir,
                                                       tmp_path):
    from snaketrl.train.batching import split_rows
    from snaketrl.train.cost import decoder

    trainer = _batch_trainer(trainer_name, tiny_model_dir, _rows(dataset, trainer_name, layout, 24), tmp_path,
                             device)
    assert trainer.model.device.type == device
    batches = list(trainer.get_train_dataloader())
    masks = []
    decoder(trainer.model).register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    whole, whole_tokens = _losses_and_grads(trainer, batches, items)
    assert trainer.model.config._attn_implementation == "sdpa" and all(mask is not None for mask in masks)
    masks.clear()
    split_rows(trainer.model)
    split, split_tokens = _losses_and_grads(trainer, batches, items)
    assert len(split) == 3 and split_tokens < whole_tokens  # shorter forwards, not one padded to the longest row
    assert len(masks) >= 3 and masks == [None] * len(masks)  # right-padded groups: sdpa's causal kernel, no mask
    for (loss, grads), (split_loss, split_grads) in zip(whole, split):
        assert split_loss == pytest.approx(loss, abs=1e-5) and split_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert split_grads[name].allclose(grad, atol=1e-5, rtol=1e-4), name


def test_row_groups_cut_where_padding_is_least():
    # Sorted 20, 30, 90, 100: one group pads to 4 x 100 = 400; cut after 30: 2 x 30 + 2 x 100 = 260.
    assert row_groups([20, 90, 30, 100]) == [[0, 2], [1, 3]]
    # Sorted 90, 100, 100, 100: a cut after the 90 saves 10 tokens, under MIN_ROW_SPLIT_TOKENS: one forward.
    assert row_groups([100, 100, 90, 100]) == [[2, 0, 1, 3]]
    assert row_groups([7]) == [[0]] and row_groups([0, 0]) == [[0, 1]]
    # Pairs (chosen, rejected) in batches of 2: [[90, 20], [30, 100]] -> rows 90, 30, 20, 100 -> 260 processed.
    per_row = np.array([[90, 20], [30, 100]])
    assert split_efficiency(per_row, 2, [0, 1]) == pytest.approx(240 / 260)
    assert batch_efficiency(per_row.max(axis=1), per_row.sum(axis=1), 2, [0, 1], rows=2) == pytest.approx(240 / 400)


def test_efficiency_counts_pairs_and_padding():
    # Batches of 2: [2, 6] twice -> 16 real of 24 processed; grouped [2, 2], [6, 6] -> none padded.
    lengths = np.array([2, 6, 2, 6])
    assert batch_efficiency(lengths, lengths, 2, [0, 1, 2, 3]) == pytest.approx(16 / 24)
    assert batch_efficiency(lengths, lengths, 2, [0, 2, 1, 3]) == 1.0
    # A pair pads both its rows to its batch's longest: 7 + 8 real tokens in 2 x 2 rows of 6.
    assert batch_efficiency(np.array([6, 4]), np.array([6 + 1, 4 + 4]), 2, [0, 1], rows=2) == pytest.approx(15 / 24)


def test_choice_per_trainer_and_attention():
    # Random batches of 8 mostly hold a 200-token example: about 105 / 200 real. Sorted mega-batches of 400
    # (snaketrl.train.sampler) mix the two lengths in about one batch each (3 of 125 batches: 0.993 real), and
    # those run as two row groups, one per length.
    lengths = np.array([10, 200] * 500)
    stats = length_stats(lengths, keep_share=1.0, round_to=8, cap=None, batch_size=8, seed=0, trainer="sft")
    b = stats["batching"]
    assert b["strategy"] == "grouped" and b["args"] == {"train_sampling_strategy": "group_by_length"}
    assert b["split_rows"] and b["expected_efficiency"] == 1.0
    assert b["padding_efficiency"] == pytest.approx(0.525, abs=0.001)
    assert b["padding_efficiency"] == pytest.approx(1 - stats["padding_share"])
    packed = choose_batching("sft", "auto", "flash_attention_2", {"padded": 0.6, "grouped": 0.95, "packed": 1.0})
    assert packed["strategy"] == "packed" and packed["args"] == {"packing": True, "packing_strategy": "bfd"}
    pairs = choose_batching("dpo", "auto", "flash_attention_2", {"padded": 0.6, "grouped": 0.8, "packed": 1.0})
    assert pairs["strategy"] == "grouped" and pairs["args"]["remove_unused_columns"] is False
    assert choose_batching("dpo", "auto", None, {"padded": 0.9, "grouped": 0.905, "packed": 1.0})["strategy"] == "padded"
    grpo = choose_batching("grpo", "auto", None, {"padded": 0.8, "grouped": 0.95, "packed": 1.0})
    assert grpo["strategy"] == "padded" and "RepeatSampler" in grpo["reason"]
    assert choose_batching("sft", "padded", None, {"padded": 0.6, "grouped": 0.95, "packed": 1.0})["args"] == {}


def test_reward_pairs_longer_than_max_length_are_dropped_not_truncated():
    pairs = np.array([[10, 12]] * 95 + [[300, 20]] * 5)
    stats = length_stats(pairs, keep_share=0.95, round_to=8, cap=None, batch_size=4, seed=0, trainer="reward")
    assert stats["max_length"] == 16 and stats["dropped"] == 5 and stats["share_truncated"] == 0.0
    dpo = length_stats(pairs, keep_share=0.95, round_to=8, cap=None, batch_size=4, seed=0, trainer="dpo")
    assert dpo["dropped"] == 0 and dpo["share_truncated"] == pytest.approx(0.05)


def test_prompts_that_fill_max_length_are_dropped_unless_packed():
    # TRL drops (SFT: completion-only loss, DPO and KTO: a prompt that fills max_length; snaketrl's ORPO as DPO)
    # what truncation leaves no completion of.
    lengths, prompts = np.array([40] * 9 + [80]), np.array([20] * 9 + [70])
    for trainer in ("sft", "dpo", "kto", "orpo"):
        stats = length_stats(lengths, keep_share=0.9, round_to=8, cap=None, batch_size=4, seed=0, trainer=trainer,
                             prompts=prompts)
        assert stats["max_length"] == 40 and stats["dropped"] == 1 and stats["share_truncated"] == 0.1
    packed = length_stats(lengths, keep_share=0.9, round_to=8, cap=None, batch_size=4, seed=0, trainer="sft",
                          prompts=prompts, batching="packed")
    assert packed["dropped"] == 0


def test_varlen_attention_matches_trl():
    from trl.trainer.sft_trainer import FLASH_ATTENTION_VARIANTS

    assert VARLEN_ATTENTION == FLASH_ATTENTION_VARIANTS | {"varlen"}  # and snaketrl.train.attention's


@pytest.mark.parametrize("batching, message", [
    ({"dpo": "packed"}, r"^config: length.batching.dpo: 'packed' is not possible for trainer 'dpo'; it can use "
                        r"padded, grouped$"),
    ("grouped", r"^config: length.batching: 'grouped' is not possible for trainer 'grpo'; it can use padded "
                r"\(TRL's RepeatSampler"),
    ({"sfft": "packed"}, r"^config: length.batching.sfft: unknown trainer; expected one of \["),
])
def test_impossible_batching_fails_at_parse_time(config, batching, message):
    config["length"]["batching"] = batching
    with pytest.raises(ConfigError, match=message):
        resolve_runs(config)


def test_batching_fields_belong_to_the_length_stage(config):
    config["trainers"]["dpo"]["args"]["train_sampling_strategy"] = "group_by_length"
    with pytest.raises(ConfigError, match=r"^config: trainers.dpo.args.train_sampling_strategy: set by the length "
                                          r"stage's batching choice \(length.batching: auto, padded, grouped, "
                                          r"packed\); remove it$"):
        resolve_runs(config)


def test_padding_free_only_where_trl_applies_it(config):
    config["trainers"]["sft"]["args"] = {"padding_free": True}
    with pytest.raises(ConfigError, match=r"padding_free: TRL 1.12 needs packing with it when max_length is set"):
        resolve_runs(config)
    config["length"]["batching"] = {"sft": "packed"}
    runs = resolve_runs(config)
    assert runs["sft-qwen2-tiny"]["args"]["padding_free"] is True
    config["trainers"]["dpo"]["args"]["padding_free"] = True
    with pytest.raises(ConfigError, match=r"run dpo-qwen2-tiny\): padding_free: TRL 1.12 applies it only in SFT"):
        resolve_runs(config)
