import json

import pytest

from conftest import ROOT
from snaketrl.data import DataError, fetch, preprocess, read_jsonl, split_rows


def test_firefly_column_mapping():
    rows = read_jsonl(ROOT / "data/samples/firefly.jsonl")[:5]
    out = preprocess(rows, dataset="firefly", trainer="sft", layout="language_modeling",
                     columns={"prompt": "input", "completion": "target"}, split="train")
    assert [list(r) for r in out] == [["prompt", "completion"]] * 5  # `kind` dropped
    assert out[0] == {"prompt": rows[0]["input"], "completion": rows[0]["target"]}


def test_missing_column_names_dataset_column_and_columns():
    rows = read_jsonl(ROOT / "data/samples/firefly.jsonl")[:3]
    with pytest.raises(DataError) as err:
        preprocess(rows, dataset="firefly", trainer="sft", layout="language_modeling", columns={}, split="train")
    assert str(err.value) == (
        "dataset 'firefly': trainer 'sft' needs columns (prompt, completion) or (messages) or (text); "
        "missing 'prompt'; columns are ['kind', 'input', 'target'] (map names with datasets.firefly.columns)")


def test_mapping_to_absent_column():
    with pytest.raises(DataError, match=r"column mapping prompt -> 'question': no column 'question'; "
                                        r"columns are \['kind', 'input', 'target'\]"):
        preprocess(read_jsonl(ROOT / "data/samples/firefly.jsonl")[:3], dataset="firefly", trainer="sft",
                   layout="language_modeling", columns={"prompt": "question"}, split="train")


def test_implicit_prompt_is_extracted_from_conversations():
    rows = read_jsonl(ROOT / "data/samples/ultrafeedback.jsonl")[:4]
    out = preprocess(rows, dataset="uf", trainer="dpo", layout="preference", columns={}, split="train")
    assert list(out[0]) == ["prompt", "chosen", "rejected"]
    assert [m["role"] for m in out[0]["prompt"]] == ["user"]
    assert [m["role"] for m in out[0]["chosen"]] == ["assistant"]
    assert out[0]["prompt"] + out[0]["chosen"] == rows[0]["chosen"]


def test_explicit_prompt_kept_for_string_preferences():
    rows = read_jsonl(ROOT / "data/samples/descriptiveness.jsonl")[:2]
    out = preprocess(rows, dataset="d", trainer="dpo", layout="preference", columns={}, split="eval")
    assert out == [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]


def test_empty_split_is_an_error():
    with pytest.raises(DataError, match=r"dataset 'tldr' \(eval split, for trainer 'sft'\): no rows"):
        preprocess([], dataset="tldr", trainer="sft", layout="language_modeling", columns={}, split="eval")


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match=rf"dataset 'x': file {tmp_path}/nope.jsonl does not exist"):
        fetch("x", {"files": str(tmp_path / "nope.jsonl")}, seed=0)


def test_split_is_deterministic_and_disjoint():
    rows = [{"i": i} for i in range(100)]
    a, b = split_rows(rows, 0.1, seed=3)
    assert (len(a), len(b)) == (90, 10)
    assert split_rows(rows, 0.1, seed=3) == (a, b)
    assert {r["i"] for r in a}.isdisjoint({r["i"] for r in b})


def test_fetch_parquet_and_explicit_eval(tmp_path):
    import pandas as pd

    pd.DataFrame({"prompt": ["a", "b", "c"], "completion": ["x", "y", "z"]}).to_parquet(tmp_path / "t.parquet")
    (tmp_path / "e.jsonl").write_text(json.dumps({"prompt": "q", "completion": "r"}) + "\n")
    train, evals = fetch("p", {"files": {"train": str(tmp_path / "t.parquet"), "eval": str(tmp_path / "e.jsonl")},
                               "max_rows": 2}, seed=0)
    assert train == [{"prompt": "a", "completion": "x"}, {"prompt": "b", "completion": "y"}]
    assert evals == [{"prompt": "q", "completion": "r"}]


def test_hub_dataset_offline_fails_at_once_naming_what_to_prefetch(monkeypatch):
    import time

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: as offline as it gets
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"^dataset 'tldr': cannot reach the Hugging Face Hub \(http://127.0.0.1:9\) "
                                        r"to fetch 'trl-lib/tldr'. On a machine with internet: "
                                        r"`datasets.load_dataset\('trl-lib/tldr'\)"):
        fetch("tldr", {"hub": "trl-lib/tldr", "split": "train[:10]"}, seed=0)
    assert time.perf_counter() - start < 5


SHARED = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data (real public samples) not beside the checkout")


@needs_shared
def test_hh_dialogues_split_at_the_last_assistant_turn():
    rows = read_jsonl(SHARED / "hh-rlhf-harmless-base/test.jsonl")[:50]
    out = preprocess(rows, dataset="hh", trainer="dpo", layout="preference", columns={}, split="train", format="hh")
    for row, src in zip(out, rows):
        assert row["prompt"].startswith("\n\nHuman:") and row["prompt"].endswith("\n\nAssistant:")
        assert row["prompt"] + row["chosen"] == src["chosen"]
        assert row["prompt"] + row["rejected"] == src["rejected"]
        assert row["chosen"] != row["rejected"]


@needs_shared
def test_alpaca_rows_become_conversations_with_history():
    rows = read_jsonl(SHARED / "lima-llamafactory/test.jsonl")
    out = preprocess(rows, dataset="lima", trainer="sft", layout="language_modeling", columns={}, split="train",
                     format="alpaca")
    multi = next(i for i, r in enumerate(rows) if r["history"])
    assert [m["role"] for m in out[multi]["prompt"]] == ["user", "assistant"] * len(rows[multi]["history"]) + ["user"]
    assert out[0]["completion"] == [{"role": "assistant", "content": rows[0]["output"]}]


@needs_shared
def test_gsm8k_and_tldr_samples_map_through_columns():
    gsm = preprocess(read_jsonl(SHARED / "gsm8k/test.jsonl")[:5], dataset="gsm8k", trainer="grpo", layout="prompt",
                     columns={"prompt": "question"}, split="train")
    assert list(gsm[0]) == ["prompt", "answer"] and "####" in gsm[0]["answer"]
    tldr = preprocess(read_jsonl(SHARED / "tldr-instructgpt-samples/test.jsonl")[:3], dataset="tldr", trainer="sft",
                      layout="language_modeling", columns={"prompt": "context", "completion": "ref_text"},
                      split="train")
    assert tldr[0]["prompt"].endswith("TL;DR:")


def test_format_needs_its_columns():
    with pytest.raises(DataError, match=r"dataset 'x': format 'alpaca' needs column 'instruction'; columns are "
                                        r"\['prompt', 'completion'\]"):
        preprocess([{"prompt": "a", "completion": "b"}], dataset="x", trainer="sft", layout="language_modeling",
                   columns={}, split="train", format="alpaca")
