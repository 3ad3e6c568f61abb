"""snaketrl's length-grouped sampler: random, reproducible, grouping small datasets too, and exactly what the
length stage estimates."""

import json

import numpy as np
import pytest

from snaketrl.data.lengths import batch_efficiency, length_grouped_batches, length_grouped_order


def _skewed(n, seed=1):
    """Lengths like the human TL;DRs': most short, a long tail, capped."""
    return np.minimum(np.random.default_rng(seed).lognormal(5.5, 0.7, size=n).astype(int) + 10, 1216)


def _order(lengths, batch_size=8, seed=3, epoch=0):
    from snaketrl.train.sampler import ShuffledLengthGroupedSampler

    sampler = ShuffledLengthGroupedSampler(batch_size, lengths=lengths.tolist(), seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_a_permutation_reproducible_per_seed_and_epoch():
    from snaketrl.train.sampler import ShuffledLengthGroupedSampler

    lengths = _skewed(41)
    order = _order(lengths)
    assert sorted(order) == list(range(41))
    assert _order(lengths) == order
    # no state carried between passes: a resumed run (new process, set_epoch) replays the same epoch
    sampler = ShuffledLengthGroupedSampler(8, lengths=lengths.tolist(), seed=3)
    sampler.set_epoch(1)
    assert list(sampler) == list(sampler) == _order(lengths, epoch=1)
    assert _order(lengths, epoch=1) != order and sorted(_order(lengths, epoch=1)) == list(range(41))
    assert _order(lengths, seed=4) != order
    # seed 3's second epoch is no other seed's first
    assert _order(lengths, seed=4, epoch=0) != _order(lengths, seed=3, epoch=1)


def test_batches_sorted_longest_first_short_batch_last():
    lengths = _skewed(41)
    order = _order(lengths)
    batches = [order[i:i + 8] for i in range(0, 41, 8)]
    assert len(batches[-1]) == 1  # 41 = 5 x 8 + 1: the short batch stays last, so the DataLoader's cuts hold
    assert lengths[batches[0]].max() == lengths.max()  # an out-of-memory error shows at the first step
    # 41 examples are one mega-batch: every full batch is a run of the sorted lengths
    ranked = sorted(lengths.tolist(), reverse=True)
    runs = {tuple(ranked[i:i + 8]) for i in range(0, 40, 8)}
    assert {tuple(sorted(lengths[b].tolist(), reverse=True)) for b in batches[:-1]} == runs
    # the batch order is shuffled, not descending, in some epoch
    firsts = [[lengths[b].max() for b in (o[i:i + 8] for i in range(0, 40, 8))] for o in
              (_order(lengths, epoch=e) for e in range(4))]
    assert any(f[1:] != sorted(f[1:], reverse=True) for f in firsts)


def test_groups_a_small_dataset_that_transformers_leaves_random():
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = _skewed(41)
    ours = [batch_efficiency(lengths, lengths, 8, _order(lengths, seed=s)) for s in range(5)]
    theirs = np.mean([batch_efficiency(lengths, lengths, 8, get_length_grouped_indices(
        lengths.tolist(), 8, generator=torch.Generator().manual_seed(s))) for s in range(5)])
    # transformers: mega-batches of 41 // 32 = 1 batch, i.e. random batches; ours: the dataset sorted whole,
    # which for batches of 8 is the least padding possible
    whole = batch_efficiency(lengths, lengths, 8, np.argsort(-lengths, kind="stable"))
    assert ours == pytest.approx([whole] * 5) and whole > theirs + 0.2


@pytest.mark.parametrize("n", [41, 1000])
def test_the_length_stage_estimates_this_sampler(n):
    import torch

    from snaketrl.train.sampler import ShuffledLengthGroupedSampler

    lengths = _skewed(n)
    sampler = ShuffledLengthGroupedSampler(8, lengths=lengths.tolist(), seed=5)
    # Its batches are length_grouped_batches of its permutation, in another order.
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([5, 0]).generate_state(1)[0]))
    expected = length_grouped_batches(lengths, 8, torch.randperm(n, generator=generator).numpy())
    order = list(sampler)
    got = [order[i:i + 8] for i in range(0, n, 8)]
    assert sorted(map(sorted, got)) == sorted(sorted(b.tolist()) for b in expected)
    # The estimate from another permutation: equal for a dataset sorted whole, close for mega-batches.
    estimate = batch_efficiency(lengths, lengths, 8, length_grouped_order(lengths, 8, seed=0))
    assert batch_efficiency(lengths, lengths, 8, order) == pytest.approx(estimate, abs=1e-12 if n < 400 else 0.01)


def test_training_uses_it_and_measures_the_estimate(config, tiny_model_dir, tmp_path):
    from conftest import ROOT
    from transformers import TrainerCallback

    from snaketrl.config import resolve_runs
    from snaketrl.data.lengths import histogram
    from snaketrl.data.preprocess import preprocess
    from snaketrl.io import read_jsonl, write_jsonl
    from snaketrl.train.run import train_run
    from snaketrl.train.sampler import ShuffledLengthGroupedSampler

    class Seen(TrainerCallback):
        samplers = []

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            # accelerate rebuilt the DataLoader around a BatchSampler of the Trainer's sampler
            self.samplers.append(type(train_dataloader.batch_sampler.sampler))

    rows = preprocess(read_jsonl(ROOT / "data/samples/tldr.jsonl"), dataset="tldr", trainer="sft",
                      layout="language_modeling", columns={}, split="train").rows
    rows = list({json.dumps(r, sort_keys=True): r for r in rows}.values())
    write_jsonl(rows[:41], tmp_path / "train.jsonl")
    write_jsonl(rows[41:49], tmp_path / "eval.jsonl")
    settings = {"trainer": "sft", "layout": "language_modeling", "keep_share": 1.0, "round_to": 8, "batch_size": 8,
                "seed": 0, "batching": "grouped", "attn_implementation": None}
    stats = histogram(tiny_model_dir, tmp_path / "train.jsonl", settings, tmp_path / "lengths.json",
                      tmp_path / "lengths.png", "sft")
    assert stats["dropped"] == 0 and stats["batching"]["strategy"] == "grouped"
    seen = Seen()
    config["training"].update({"num_train_epochs": 1, "max_steps": -1, "logging_steps": 1, "eval_strategy": "no",
                               "save_strategy": "no"})
    run = resolve_runs(config)["sft-qwen2-tiny"]
    metrics = train_run(run, model_dir=tiny_model_dir, train_file=tmp_path / "train.jsonl",
                        eval_file=tmp_path / "eval.jsonl", lengths_file=tmp_path / "lengths.json",
                        out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", callbacks=[seen])
    assert seen.samplers == [ShuffledLengthGroupedSampler]
    # 41 examples are one mega-batch: the batches are fixed by their lengths, so measured = estimated.
    assert metrics["token_efficiency"] == pytest.approx(stats["batching"]["expected_efficiency"], abs=1e-9)
    assert stats["batching"]["expected_efficiency"] > stats["batching"]["padding_efficiency"] + 0.05
