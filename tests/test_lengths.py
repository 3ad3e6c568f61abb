import numpy as np
import pytest

from conftest import ROOT
from snaketrl.data.lengths import choose_max_length, length_stats, padding_share, sequence_lengths
from snaketrl.data.preprocess import preprocess
from snaketrl.errors import DataError
from snaketrl.io import read_jsonl


def test_choose_max_length_rounds_up_the_keep_share_quantile():
    lengths = np.array([10] * 98 + [100, 300])
    assert choose_max_length(lengths, 0.99, 32, cap=None) == 128  # 99th pct is 100 -> next multiple of 32
    assert choose_max_length(lengths, 0.98, 32, cap=None) == 32
    assert choose_max_length(lengths, 1.0, 32, cap=None) == 320
    assert choose_max_length(lengths, 1.0, 32, cap=256) == 256


def test_stats_share_truncated_and_padding():
    lengths = np.array([10] * 98 + [100, 300])
    stats = length_stats(lengths, keep_share=0.99, round_to=32, cap=None, batch_size=4, seed=0)
    assert stats["max_length"] == 128
    assert stats["share_truncated"] == pytest.approx(0.01)
    assert stats["percentiles"]["p50"] == 10 and stats["percentiles"]["p100"] == 300
    assert 0 < stats["padding_share"] < 1


def test_ceiling_lowers_max_length_and_says_what_it_truncates():
    lengths = np.array([10] * 60 + [100] * 30 + [300] * 10)
    free = length_stats(lengths, keep_share=0.99, round_to=32, cap=512, batch_size=4, seed=0)
    capped = length_stats(lengths, keep_share=0.99, round_to=32, cap=512, batch_size=4, seed=0, ceiling=64)
    assert free["max_length"] == 320 and free["share_truncated"] == 0.0
    assert (capped["max_length"], capped["keep_share_max_length"], capped["max_length_ceiling"]) == (64, 320, 64)
    assert capped["share_truncated"] == pytest.approx(0.4)  # the 100- and 300-token examples
    loose = length_stats(lengths, keep_share=0.5, round_to=32, cap=512, batch_size=4, seed=0, ceiling=64)
    assert loose["max_length"] == 32 and loose["keep_share_max_length"] == 32  # under the ceiling: keep_share's
    # A trainer that drops what is too long counts what the ceiling drops.
    reward = length_stats(lengths, keep_share=0.99, round_to=32, cap=512, batch_size=4, seed=0, ceiling=64,
                          trainer="reward")
    assert reward["dropped"] == 40 and reward["share_truncated"] == 0.0
    with pytest.raises(DataError, match=r"drops every example at max_length=8 \(length.max_length: 8\)"):
        length_stats(lengths, keep_share=0.99, round_to=32, cap=512, batch_size=4, seed=0, ceiling=8,
                     trainer="reward")


def test_mean_tokens_counts_every_row_truncated_and_leaves_out_what_is_dropped():
    """What max_tokens divides by: an example's real tokens as trained (a pair's two rows, each cut to max_length)."""
    pairs = np.array([[10, 12], [20, 30], [100, 300]])
    stats = length_stats(pairs, keep_share=1.0, round_to=32, cap=None, batch_size=2, seed=0, trainer="dpo",
                         ceiling=64)
    assert stats["max_length"] == 64 and stats["mean_tokens"] == pytest.approx((22 + 50 + 64 + 64) / 3)
    reward = length_stats(pairs, keep_share=1.0, round_to=32, cap=None, batch_size=2, seed=0, trainer="reward",
                          ceiling=64)
    assert reward["dropped"] == 1 and reward["mean_tokens"] == pytest.approx((22 + 50) / 2)


def test_padding_share_is_zero_for_equal_lengths():
    assert padding_share(np.array([7] * 16), 64, 4, seed=0) == 0.0
    # Two sequences, 2 and 6 long, in one batch: 4 of 12 slots are padding.
    assert padding_share(np.array([2, 6]), 64, 2, seed=0) == pytest.approx(4 / 12)


def _trl_length(tokenizer, prompt, completion):
    """Length as TRL's trainers compute it (trl.data_utils._tokenize on prompt + completion)."""
    from trl.data_utils import _tokenize

    return len(_tokenize(tokenizer, prompt + completion)["input_ids"])


def test_sft_lengths_match_trl_tokenization(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = read_jsonl(ROOT / "data/samples/tldr.jsonl")[:20]
    ours = sequence_lengths(rows, tok, "language_modeling")
    expected = [_trl_length(tok, r["prompt"], r["completion"] + tok.eos_token) for r in rows]
    assert ours.tolist() == expected


def test_dpo_lengths_match_trl_tokenization(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = preprocess(read_jsonl(ROOT / "data/samples/ultrafeedback.jsonl")[:20], dataset="uf", trainer="dpo",
                      layout="preference", columns={}, split="train").rows
    ours = sequence_lengths(rows, tok, "preference")
    expected = [max(_trl_length(tok, r["prompt"], r["chosen"]), _trl_length(tok, r["prompt"], r["rejected"]))
                for r in rows]
    assert ours.tolist() == expected
    assert all(n > 10 for n in expected)
