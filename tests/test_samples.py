import json

from conftest import ROOT
import random

import pytest

from snaketrl.data.samples import (GENERATORS, arithmetic, arithmetic_carry, arithmetic_mixed, carries, sum_operands,
                                   unseen_sums, write_samples)


def test_shipped_samples_are_what_the_generator_writes(tmp_path):
    for path in write_samples(tmp_path):
        assert path.read_bytes() == (ROOT / "data" / "samples" / path.name).read_bytes(), path.name


def test_samples_have_the_hub_schemas(tmp_path):
    rows = {p.stem: [json.loads(x) for x in p.read_text().splitlines()] for p in write_samples(tmp_path, n=50)}
    assert set(rows) == set(GENERATORS) | {"arithmetic_carry", "arithmetic_mixed"}
    assert set(rows["tldr"][0]) == {"prompt", "completion"}
    assert rows["tldr"][0]["prompt"].endswith("TL;DR:")
    assert set(rows["ultrafeedback"][0]) == {"chosen", "rejected", "score_chosen", "score_rejected"}
    assert [m["role"] for m in rows["ultrafeedback"][0]["chosen"]] == ["user", "assistant"]
    assert set(rows["descriptiveness"][0]) == {"prompt", "chosen", "rejected"}
    assert set(rows["firefly"][0]) == {"kind", "input", "target"}
    assert all(set(rows[name][0]) == {"question", "answer"} for name in ("arithmetic", "arithmetic_carry", "arithmetic_mixed"))
    assert all(len(r) == 50 for r in rows.values())


def test_tldr_completion_restates_the_post(tmp_path):
    # The learnable signal: every word of the summary's subject appears in the post.
    for row in json.loads("[" + ",".join((ROOT / "data/samples/tldr.jsonl").read_text().splitlines()) + "]"):
        name = row["completion"].split()[0]
        assert name in row["prompt"]


def shipped(name: str) -> list[dict]:
    return [json.loads(x) for x in (ROOT / "data/samples" / f"{name}.jsonl").read_text().splitlines()]


def operand_pairs(rows: list[dict]) -> list[tuple[int, int]]:
    return [tuple(map(int, r["answer"].split("<<")[1].split("=")[0].split("+"))) for r in rows]


def test_carry_sample_carries_and_shares_no_sum_with_the_arithmetic_sample():
    rows = shipped("arithmetic_carry")
    assert len(rows) == 400
    pairs = operand_pairs(rows)
    assert len(set(pairs)) == 400 and len(sum_operands(rows)) == 223    # no sum twice; 177 in both orders
    assert all(2 <= a <= 40 and 2 <= b <= 40 and a % 10 + b % 10 >= 10 for a, b in pairs)
    assert not sum_operands(rows) & sum_operands(shipped("arithmetic"))
    assert rows[0]["answer"] == "Taylor has 15 + 5 = <<15+5=20>>20 stickers.\n#### 20"


def test_carry_sample_refuses_more_rows_than_carrying_sums():
    taken = sum_operands(arithmetic(400, random.Random("0-arithmetic")))
    with pytest.raises(ValueError, match=r"^arithmetic_carry: 435 carrying rows asked for, 434 carrying sums not in the arithmetic sample$"):
        arithmetic_carry(435, random.Random(0), taken)


def test_mixed_sample_is_half_carrying_and_shares_no_sum_with_the_arithmetic_sample():
    rows = shipped("arithmetic_mixed")
    pairs = operand_pairs(rows)
    assert len(rows) == 400 and len(set(pairs)) == 400 and len(sum_operands(rows)) == 316
    assert sum(carries(a, b) for a, b in pairs) == 200
    assert [carries(a, b) for a, b in pairs[:8]] == [False, False, False, True, False, False, True, True]    # shuffled
    assert all(2 <= a <= 40 and 2 <= b <= 40 for a, b in pairs)
    assert not sum_operands(rows) & sum_operands(shipped("arithmetic"))
    assert rows[0]["answer"] == "Riley has 35 + 13 = <<35+13=48>>48 apples.\n#### 48"


def test_mixed_sample_refuses_more_rows_than_unseen_sums_of_either_kind():
    taken = sum_operands(arithmetic(400, random.Random("0-arithmetic")))
    assert len(arithmetic_mixed(868, random.Random(0), taken)) == 868
    with pytest.raises(ValueError, match=r"^arithmetic_mixed: 435 carrying rows asked for, 434 carrying sums not in the arithmetic sample$"):
        arithmetic_mixed(870, random.Random(0), taken)
    with pytest.raises(ValueError, match=r"^arithmetic_mixed: 462 non-carrying rows asked for, 461 non-carrying sums not in the arithmetic sample$"):
        unseen_sums(462, random.Random(0), taken, False, "arithmetic_mixed")
