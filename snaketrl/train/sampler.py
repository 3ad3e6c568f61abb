"""snaketrl's length-grouped sampler: the batching `grouped` trains with (length.batching).

transformers' LengthGroupedSampler sorts random mega-batches of min(n // (4 x batch), 50) batches and keeps
them in that order, longest first. Its n // (4 x batch) keeps randomness in the sequence of batches of a small
dataset, at the price of not grouping it: 41 examples in batches of 8 form mega-batches of one batch. This
sampler always forms mega-batches of 50 batches (a smaller dataset is sorted whole) and gets the randomness
back by shuffling the order of the batches instead; the examples of each batch are drawn from a random
permutation as in transformers. Its batches are `snaketrl.data.lengths.length_grouped_batches`, which the length
stage's estimate uses too.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

from snaketrl.data.lengths import length_grouped_batches


class ShuffledLengthGroupedSampler(LengthGroupedSampler):
    """Length-grouped batches of `batch_size` in a shuffled order, the batch holding the longest examples first
    (an out-of-memory error shows at the first step, as with transformers' sampler) and a short last batch
    last (the DataLoader cuts the indices into batches in order). The order depends only on `seed` and the
    epoch (`set_epoch`, which the Trainer calls at every epoch, also after a resume), so a resumed run skips
    exactly the batches it had trained on."""

    def __init__(self, batch_size: int, dataset=None, lengths=None, model_input_name: str | None = None,
                 seed: int = 0):
        super().__init__(batch_size, dataset=dataset, lengths=lengths, model_input_name=model_input_name)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        # One stream per (seed, epoch), not seed + epoch: seed 1's second epoch must not replay seed 2's first.
        self.generator = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.epoch])
                                                           .generate_state(1)[0]))
        lengths = np.asarray(self.lengths)
        perm = torch.randperm(len(lengths), generator=self.generator).numpy()
        batches = length_grouped_batches(lengths, self.batch_size, perm)
        tail = [batches.pop()] if len(batches[-1]) < self.batch_size else []
        if not batches:
            return iter(tail[0].tolist())
        order = torch.randperm(len(batches), generator=self.generator).tolist()
        first = max(order, key=lambda b: lengths[batches[b]].max())
        order.remove(first)
        return iter([int(i) for b in [first, *order] for i in batches[b]] + [int(i) for b in tail for i in b])


class ShuffledLengthGroupedMixin:
    """A Trainer whose `group_by_length` sampling uses ShuffledLengthGroupedSampler; the lengths are those
    transformers' own sampler measured (the `length_column_name` column, else the model inputs). `group_rows`:
    the rows grouped together, where not one batch: processes that split one process's batch among them take
    consecutive batches of one group (accelerate deals them out in turn), so each step trains the rows one
    process would."""

    group_rows: int | None = None

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        if self.args.train_sampling_strategy != "group_by_length" or not isinstance(sampler, LengthGroupedSampler):
            return sampler
        # One batch of the DataLoader (transformers groups in optimizer steps of gradient_accumulation_steps
        # batches; what is padded together is one batch).
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return ShuffledLengthGroupedSampler(self.group_rows or self.args.train_batch_size, lengths=sampler.lengths,
                                            seed=seed)


def with_grouped_sampler(trainer_cls: type, group_rows: int | None = None) -> type:
    """`trainer_cls` (a transformers Trainer subclass) with ShuffledLengthGroupedMixin, under its own name."""
    return type(trainer_cls.__name__, (ShuffledLengthGroupedMixin, trainer_cls),
                {"__module__": __name__, "group_rows": group_rows})
