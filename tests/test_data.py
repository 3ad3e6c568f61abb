import json

import pytest

from conftest import ROOT
from snaketrl.data.fetch import fetch, split_rows
from snaketrl.data.preprocess import preprocess
from snaketrl.errors import DataError
from snaketrl.io import read_jsonl


def prep(rows, **kw):
    """The rows preprocess keeps, for tests of well-formed data."""
    return preprocess(rows, **kw).rows


def test_firefly_column_mapping():
    rows = read_jsonl(ROOT / "data/samples/firefly.jsonl")[:5]
    out = prep(rows, dataset="firefly", trainer="sft", layout="language_modeling",
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
    out = prep(rows, dataset="uf", trainer="dpo", layout="preference", columns={}, split="train")
    assert list(out[0]) == ["prompt", "chosen", "rejected"]
    assert [m["role"] for m in out[0]["prompt"]] == ["user"]
    assert [m["role"] for m in out[0]["chosen"]] == ["assistant"]
    assert out[0]["prompt"] + out[0]["chosen"] == rows[0]["chosen"]


def test_explicit_prompt_kept_for_string_preferences():
    rows = read_jsonl(ROOT / "data/samples/descriptiveness.jsonl")[:2]
    out = prep(rows, dataset="d", trainer="dpo", layout="preference", columns={}, split="eval")
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
    got = fetch("p", {"files": {"train": str(tmp_path / "t.parquet"), "eval": str(tmp_path / "e.jsonl")},
                      "max_rows": 2}, seed=0)
    assert got.train == [{"prompt": "a", "completion": "x"}, {"prompt": "b", "completion": "y"}]
    assert got.eval == [{"prompt": "q", "completion": "r"}]
    assert got.origin == {"train": {"file": str(tmp_path / "t.parquet"), "rows": [0, 1]},
                          "eval": {"file": str(tmp_path / "e.jsonl"), "lines": [1]}}


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
    out = prep(rows, dataset="hh", trainer="dpo", layout="preference", columns={}, split="train", format="hh")
    for row, src in zip(out, rows):
        assert row["prompt"].startswith("\n\nHuman:") and row["prompt"].endswith("\n\nAssistant:")
        assert row["prompt"] + row["chosen"] == src["chosen"]
        assert row["prompt"] + row["rejected"] == src["rejected"]
        assert row["chosen"] != row["rejected"]


@needs_shared
def test_alpaca_rows_become_conversations_with_history():
    rows = read_jsonl(SHARED / "lima-llamafactory/test.jsonl")
    out = prep(rows, dataset="lima", trainer="sft", layout="language_modeling", columns={}, split="train",
               format="alpaca")
    multi = next(i for i, r in enumerate(rows) if r["history"])
    assert [m["role"] for m in out[multi]["prompt"]] == ["user", "assistant"] * len(rows[multi]["history"]) + ["user"]
    assert out[0]["completion"] == [{"role": "assistant", "content": rows[0]["output"]}]


@needs_shared
def test_gsm8k_and_tldr_samples_map_through_columns():
    gsm = prep(read_jsonl(SHARED / "gsm8k/test.jsonl")[:5], dataset="gsm8k", trainer="grpo", layout="prompt",
               columns={"prompt": "question"}, split="train")
    assert list(gsm[0]) == ["prompt", "answer"] and "####" in gsm[0]["answer"]
    tldr = prep(read_jsonl(SHARED / "tldr-instructgpt-samples/test.jsonl")[:3], dataset="tldr", trainer="sft",
                layout="language_modeling", columns={"prompt": "context", "completion": "ref_text"},
                split="train")
    assert tldr[0]["prompt"].endswith("TL;DR:")


def test_format_needs_its_columns():
    with pytest.raises(DataError, match=r"dataset 'x': format 'alpaca' needs column 'instruction'; columns are "
                                        r"\['prompt', 'completion'\]"):
        preprocess([{"prompt": "a", "completion": "b"}], dataset="x", trainer="sft", layout="language_modeling",
                   columns={}, split="train", format="alpaca")


# --- Bad input: each kind is one exact, located line ---------------------------------------------

GOOD = {"prompt": "Say hi.", "completion": " Hi."}


def write_lines(path, lines: list[bytes | str | dict]) -> str:
    """A JSON Lines file of `lines` as given (dicts are dumped), so a test can break any one of them."""
    raw = [x if isinstance(x, bytes) else (json.dumps(x) if isinstance(x, dict) else x).encode() for x in lines]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return str(path)


def fetch_error(path, bad_rows="error") -> str:
    with pytest.raises(DataError) as err:
        fetch("tldr", {"files": path, "bad_rows": bad_rows}, seed=0)
    return str(err.value)


def test_malformed_json_line_names_file_line_and_column(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [GOOD, GOOD, '{"prompt": "a" "completion": "b"}', GOOD])
    assert fetch_error(path) == (f"dataset 'tldr': {path} line 3: not valid JSON (Expecting ',' delimiter at "
                                 f"column 16)")


def test_bytes_that_are_not_utf8_name_the_line_and_byte_offset(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [GOOD, '{"prompt": "caf'.encode() + b"\xe9" + b'", "completion": "x"}'])
    assert fetch_error(path) == (f"dataset 'tldr': {path} line 2: not valid UTF-8 (byte 0xe9 at byte offset 15 of "
                                 f"the line; save the file as UTF-8)")


def test_a_line_that_is_json_but_not_an_object(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [GOOD, '["Say hi.", " Hi."]', GOOD])
    assert fetch_error(path) == f"dataset 'tldr': {path} line 2: expected a JSON object {{...}}, got a list"


def test_a_lone_surrogate_escape_is_caught_before_it_breaks_the_writer(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [GOOD, '{"prompt": "a\\ud83d", "completion": "b"}',
                                              '{"prompt": "\\ud83d\\ude00", "completion": "b"}'])
    assert fetch_error(path) == (f"dataset 'tldr': {path} line 2: not valid text: a lone UTF-16 surrogate "
                                 f"'\\ud83d' that UTF-8 cannot store")


def test_the_error_counts_the_other_bad_lines_and_names_the_switch(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [GOOD, "{", "nope", GOOD, "[]"])
    assert fetch_error(path) == (f"dataset 'tldr': {path} line 2: not valid JSON (Expecting property name enclosed "
                                 f"in double quotes at column 2) (and 2 more bad rows; datasets.tldr.bad_rows: drop "
                                 f"skips them)")


def test_blank_lines_and_a_byte_order_mark_are_fine_and_lines_keep_counting(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(json.dumps(r).encode() for r in (
        {"prompt": "0", "completion": "a"}, {"prompt": "1", "completion": "b"})) + b"\n\n\n" +
        json.dumps({"prompt": "2", "completion": "c"}).encode() + b"\n")
    got = fetch("x", {"files": str(path), "eval_size": 0.4}, seed=0)
    numbers = got.origin["train"]["lines"] + got.origin["eval"]["lines"]
    assert sorted(numbers) == [1, 2, 5]
    assert {int(r["prompt"]) for r in got.train + got.eval} == {0, 1, 2}


def test_origin_points_every_row_at_its_line_through_the_split_and_max_rows(tmp_path):
    lines = [{"prompt": f"p{i}", "completion": f"c{i}"} if i % 7 else "" for i in range(1, 60)]
    path = write_lines(tmp_path / "x.jsonl", lines)
    got = fetch("x", {"files": path, "eval_size": 0.2, "max_rows": 30}, seed=5)
    text = (tmp_path / "x.jsonl").read_text().split("\n")
    for split, rows in (("train", got.train), ("eval", got.eval)):
        origin = got.origin[split]
        assert origin["file"] == path and len(origin["lines"]) == len(rows)
        assert [json.loads(text[n - 1]) for n in origin["lines"]] == rows
        assert origin["lines"] == sorted(origin["lines"])  # file order within each split
    assert len(got.train) == 30 and not set(got.origin["train"]["lines"]) & set(got.origin["eval"]["lines"])


def test_json_array_file_rows_keep_the_line_they_start_on(tmp_path):
    (tmp_path / "a.json").write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c",\n'
                                     '   "output": "d"},\n  "oops",\n  {"instruction": "e", "output": "f"}\n]\n')
    path = str(tmp_path / "a.json")
    assert fetch_error(path) == f"dataset 'tldr': {path} line 5: expected a JSON object {{...}}, got a string"
    got = fetch("tldr", {"files": {"train": path, "eval": path}, "bad_rows": "drop"}, seed=0)
    assert got.origin["train"] == {"file": path, "lines": [2, 3, 6]}
    assert got.dropped.count == 2  # once per file: train and eval are the same file here
    assert got.dropped.reasons[0] == f"{path} line 5: expected a JSON object {{...}}, got a string"


def test_json_array_syntax_error_stops_even_when_dropping(tmp_path):
    (tmp_path / "a.json").write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c"}\n'
                                     '  {"instruction": "e", "output": "f"}\n]\n')
    path = str(tmp_path / "a.json")
    assert fetch_error(path, "drop") == (f"dataset 'tldr': {path} line 4: not valid JSON (Expecting ',' delimiter "
                                         f"at column 3)")
    (tmp_path / "a.json").write_text('[{"instruction": "a", "output": "b"},]')
    assert fetch_error(path) == f"dataset 'tldr': {path} line 1: not valid JSON (Expecting value at column 38)"


def test_drop_mode_in_fetch_counts_and_keeps_the_rest(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [GOOD] * 8 + ["{", b"\xff", "1"] + [GOOD] * 4)
    got = fetch("x", {"files": path, "bad_rows": "drop"}, seed=0)
    assert len(got.train) + len(got.eval) == 12
    assert got.dropped.to_json() == {"count": 3, "reasons_omitted": 0, "reasons": [
        f"{path} line 9: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{path} line 10: not valid UTF-8 (byte 0xff at byte offset 0 of the line; save the file as UTF-8)",
        f"{path} line 11: expected a JSON object {{...}}, got a number (1)"]}
    assert 10 not in got.origin["train"]["lines"] + got.origin["eval"]["lines"]


def test_dropping_every_line_is_an_error_naming_the_first(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", ["{", "["])
    assert fetch_error(path, "drop") == (f"dataset 'tldr': the train split is empty after dropping 2 bad rows "
                                         f"(first: {path} line 1: not valid JSON (Expecting property name enclosed "
                                         f"in double quotes at column 2))")


def test_unknown_bad_rows_value_is_a_config_error(tmp_path):
    from snaketrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^dataset 'x': bad_rows must be one of error, drop, got 'skip'$"):
        fetch("x", {"files": write_lines(tmp_path / "x.jsonl", [GOOD] * 3), "bad_rows": "skip"}, seed=0)


def test_schema_defaults_bad_rows_to_error(config):
    assert {entry["bad_rows"] for entry in config["datasets"].values()} == {"error"}


def sft_error(rows, layout="language_modeling", columns=None, fmt=None, origin="data/x.jsonl", **kw) -> str:
    with pytest.raises(DataError) as err:
        preprocess(rows, dataset="tldr", trainer="sft", layout=layout, columns=columns or {}, split="train",
                   format=fmt, origin=origin, **kw)
    return str(err.value)


def bad_second_row(**row) -> str:
    """The error for a language-modeling dataset whose second row is `row`."""
    return sft_error([GOOD, row, GOOD])


def test_null_names_source_line_column_and_expectation():
    origin = {"file": "data/samples/tldr.jsonl", "lines": [3, 57, 80]}
    assert sft_error([GOOD, {"prompt": "Say hi.", "completion": None}, GOOD], origin=origin) == (
        "dataset 'tldr': data/samples/tldr.jsonl line 57: column 'completion': expected a non-empty string, got null")


def test_empty_and_whitespace_only_strings():
    assert bad_second_row(prompt="Say hi.", completion="") == (
        "dataset 'tldr': data/x.jsonl line 2: column 'completion': expected a non-empty string, got an empty string")
    assert bad_second_row(prompt=" \n", completion="x") == (
        "dataset 'tldr': data/x.jsonl line 2: column 'prompt': expected a non-empty string, got a whitespace-only "
        "string")


def test_wrong_type_and_missing_column():
    assert bad_second_row(prompt=42, completion=True) == (
        "dataset 'tldr': data/x.jsonl line 2: column 'prompt': expected a non-empty string or a non-empty list of "
        "{role, content} messages, got a number (42)")
    assert bad_second_row(prompt="Say hi.") == (
        "dataset 'tldr': data/x.jsonl line 2: column 'completion': expected a non-empty string, got nothing (the row "
        "has no such column)")
    assert sft_error([{"text": "a"}, {"text": ["a"]}], origin=None) == (
        "dataset 'tldr': train split row 1: column 'text': expected a non-empty string, got a list")


def test_a_mapped_column_is_named_as_the_user_wrote_it():
    rows = [{"input": "q", "target": "a"}, {"input": "q", "target": None}]
    assert sft_error(rows, columns={"prompt": "input", "completion": "target"}) == (
        "dataset 'tldr': data/x.jsonl line 2: column 'target' (as 'completion'): expected a non-empty string, "
        "got null")


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("message, problem", [
    ({"content": "Hi"}, "message 2: expected keys 'role' and 'content', got keys 'content'"),
    ({"from": "human", "value": "Hi"}, "message 2: expected keys 'role' and 'content', got keys 'from', 'value'"),
    ({"role": "human", "content": "Hi"}, "message 2: expected a role among system, user, assistant, tool, got 'human'"),
    ({"role": "assistant", "content": None}, "message 2: content: expected a non-empty string, got null"),
    ({"role": "assistant", "content": ["Hi"]}, "message 2: content: expected a non-empty string, got a list"),
    ({"role": "assistant", "content": " "}, "message 2: content: expected a non-empty string, got a whitespace-only "
                                            "string"),
    ("Hi", "message 2: expected an object with 'role' and 'content', got a string"),
])
def test_bad_message_lists(message, problem):
    assert sft_error([{"messages": [USER, {"role": "assistant", "content": "Yo"}]}, {"messages": [USER, message]}]) \
        == f"dataset 'tldr': data/x.jsonl line 2: column 'messages': {problem}"


def test_empty_conversation_and_empty_system_message():
    assert sft_error([{"messages": [USER]}, {"messages": []}]) == (
        "dataset 'tldr': data/x.jsonl line 2: column 'messages': expected a non-empty list of {role, content} "
        "messages, got an empty list")
    rows = [{"messages": [{"role": "system", "content": ""}, USER, {"role": "assistant", "content": "Yo"}]}]
    assert prep(rows, dataset="d", trainer="sft", layout="language_modeling", columns={}, split="train") == rows


def test_prompt_and_completion_must_be_the_same_kind():
    assert bad_second_row(prompt=[USER], completion="Hello") == (
        "dataset 'tldr': data/x.jsonl line 2: columns 'prompt' and 'completion': expected both strings or both "
        "conversations, got a conversation and a string")
    assert sft_error([{"prompt": "q", "chosen": "a", "rejected": [USER]}], layout="preference") == (
        "dataset 'tldr': data/x.jsonl line 1: columns 'prompt' and 'rejected': expected both strings or both "
        "conversations, got a string and a conversation")
    # With one side null the other side says which kind was meant.
    assert bad_second_row(prompt=None, completion=[{"role": "assistant", "content": "Yo"}]) == (
        "dataset 'tldr': data/x.jsonl line 2: column 'prompt': expected a non-empty list of {role, content} "
        "messages, got null")


def test_implicit_prompt_rows_need_a_shared_start_and_a_difference():
    assert sft_error([{"chosen": "The sky is blue.", "rejected": "Grass is green."}], layout="preference") == (
        "dataset 'tldr': data/x.jsonl line 1: columns 'chosen' and 'rejected': expected a shared beginning (the "
        "prompt, as there is no 'prompt' column), got none")
    assert sft_error([{"chosen": "The sky is blue.", "rejected": "The sky is blue."}], layout="preference") == (
        "dataset 'tldr': data/x.jsonl line 1: column 'chosen': expected a non-empty string after the prompt it "
        "shares with 'rejected', got an empty string")
    conv = [USER, {"role": "assistant", "content": "Yo"}]
    assert sft_error([{"chosen": conv, "rejected": conv[:1]}], layout="preference") == (
        "dataset 'tldr': data/x.jsonl line 1: column 'rejected': expected messages after the prompt it shares with "
        "'chosen', got none")


def test_answer_must_be_a_string():
    assert sft_error([{"question": "1+1?", "answer": 2}], layout="prompt", columns={"prompt": "question"}) == (
        "dataset 'tldr': data/x.jsonl line 1: column 'answer': expected a non-empty string, got a number (2)")


@pytest.mark.parametrize("row, problem", [
    ({"instruction": "Hi"}, "column 'output': expected a non-empty string, got nothing (the row has no such column)"),
    ({"instruction": "Hi", "output": None}, "column 'output': expected a non-empty string, got null"),
    ({"instruction": None, "output": "Yo"}, "column 'instruction': expected a non-empty string, got null"),
    ({"instruction": "Hi", "input": 3, "output": "Yo"}, "column 'input': expected a string or null, got a number (3)"),
    ({"instruction": "Hi", "output": "Yo", "history": [["Hi"]]},
     "column 'history': turn 1: expected a [user, assistant] pair of non-empty strings, got a list"),
    ({"instruction": "Hi", "output": "Yo", "history": "Hi"},
     "column 'history': expected a list of [user, assistant] pairs, got a string"),
])
def test_alpaca_source_rows_with_missing_fields(row, problem):
    good = {"instruction": "Hi", "input": "", "output": "Yo", "history": []}
    assert sft_error([good, row], fmt="alpaca") == f"dataset 'tldr': data/x.jsonl line 2: {problem}"


HH = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi\n\nAssistant: Go away."}


@pytest.mark.parametrize("row, problem", [
    ({"chosen": HH["chosen"]}, "column 'rejected': expected a non-empty string, got nothing (the row has no such "
                               "column)"),
    ({"chosen": HH["chosen"], "rejected": None}, "column 'rejected': expected a non-empty string, got null"),
    ({"chosen": "Hello!", "rejected": "Go away."}, "columns 'chosen' and 'rejected': expected a shared dialogue up to "
                                                   "an '\\n\\nAssistant:' turn, got none"),
    ({"chosen": "\n\nHuman: Hi\n\nAssistant:", "rejected": HH["rejected"]},
     "column 'chosen': expected a non-empty string, got an empty string"),
])
def test_hh_source_rows_with_missing_fields(row, problem):
    where = "line 2, after format 'hh'" if problem.startswith("column 'chosen'") else "line 2"
    assert sft_error([HH, row], layout="preference", fmt="hh") == f"dataset 'tldr': data/x.jsonl {where}: {problem}"


def test_hub_and_parquet_origins_name_split_and_row_index():
    rows = [GOOD, GOOD, {"prompt": "a", "completion": 1}]
    assert sft_error(rows, origin={"hub": "trl-lib/tldr", "split": "train[:500]", "rows": [4, 9, 17]}) == (
        "dataset 'tldr': trl-lib/tldr split 'train[:500]' row 17: column 'completion': expected a non-empty string, "
        "got a number (1)")
    assert sft_error(rows, origin={"file": "d.parquet", "rows": [0, 1, 2]}).startswith(
        "dataset 'tldr': d.parquet row 2: column 'completion'")


def test_drop_mode_in_preprocess_counts_and_caps_the_reasons():
    from snaketrl.data.schema import MAX_REASONS

    rows = [GOOD, {"prompt": "x", "completion": None}] * (MAX_REASONS + 5)
    got = preprocess(rows, dataset="d", trainer="sft", layout="language_modeling", columns={}, split="eval",
                     origin="raw/eval.jsonl", bad_rows="drop")
    assert got.rows == [GOOD] * (MAX_REASONS + 5)
    summary = got.dropped.to_json()
    assert (summary["count"], len(summary["reasons"]), summary["reasons_omitted"]) == (MAX_REASONS + 5, MAX_REASONS, 5)
    assert summary["reasons"][:2] == [
        "raw/eval.jsonl line 2: column 'completion': expected a non-empty string, got null",
        "raw/eval.jsonl line 4: column 'completion': expected a non-empty string, got null"]


def test_dropping_every_row_in_preprocess_is_an_error():
    assert sft_error([{"instruction": "Hi", "output": None}], fmt="alpaca", bad_rows="drop") == (
        "dataset 'tldr' (train split, for trainer 'sft'): no rows left after dropping 1 bad row (first: data/x.jsonl "
        "line 1: column 'output': expected a non-empty string, got null)")
    assert sft_error([{"prompt": "a", "completion": ""}] * 2, bad_rows="drop") == (
        "dataset 'tldr' (train split, for trainer 'sft'): no rows left after dropping 2 bad rows (first: "
        "data/x.jsonl line 1: column 'completion': expected a non-empty string, got an empty string)")


def test_origin_that_does_not_match_the_rows_is_a_bug_not_a_data_error():
    with pytest.raises(ValueError, match=r"^origin lists 1 train rows, but there are 3$") as err:
        preprocess([GOOD] * 3, dataset="d", trainer="sft", layout="language_modeling", columns={}, split="train",
                   origin={"file": "x.jsonl", "lines": [1]})
    assert not isinstance(err.value, DataError)


def test_shipped_samples_are_clean():
    for name, layout, columns in (("tldr", "language_modeling", {}), ("ultrafeedback", "preference", {}),
                                  ("descriptiveness", "preference", {}),
                                  ("arithmetic", "prompt", {"prompt": "question"}),
                                  ("firefly", "language_modeling", {"prompt": "input", "completion": "target"})):
        got = fetch(name, {"files": str(ROOT / f"data/samples/{name}.jsonl")}, seed=0)
        assert got.dropped.count == 0
        for split in ("train", "eval"):
            rows = getattr(got, split)
            assert preprocess(rows, dataset=name, trainer="t", layout=layout, columns=columns, split=split,
                              origin=got.origin[split]).dropped.count == 0


# --- The lean helpers agree with TRL's -----------------------------------------------------------

CHAT = [{"role": "user", "content": "What color is the sky?"}]


@pytest.mark.parametrize("chosen, rejected", [
    ("The sky is blue.", "The sky is green."),
    ("Q: 2+2? A: 4", "Q: 2+2? A: 5"),
    ("The sky is blue.", "The sky was never green."),
    (CHAT + [{"role": "assistant", "content": "Blue."}], CHAT + [{"role": "assistant", "content": "Green."}]),
    (CHAT + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Sure?"},
             {"role": "assistant", "content": "Yes."}],
     CHAT + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Sure?"},
             {"role": "assistant", "content": "No."}]),
])
def test_implicit_prompt_split_and_conversation_check_agree_with_trl(chosen, rejected):
    trl = pytest.importorskip("trl.data_utils")
    from snaketrl.data.formats import is_conversational

    ours = prep([{"chosen": chosen, "rejected": rejected}], dataset="d", trainer="dpo", layout="preference",
                columns={}, split="train")
    assert ours == [trl.extract_prompt({"chosen": chosen, "rejected": rejected})]
    for value in (chosen, rejected, "text", ["a", "b"], [{"content": "no role"}]):
        assert is_conversational(value) == trl.is_conversational({"prompt": value})


def test_distinct_keeps_each_values_first_row_and_no_eval_row_repeats_a_train_rows(tmp_path):
    # tldr-instructgpt-samples' layout: each post (`context`) on consecutive rows, one per model's sample.
    train = [{"context": f"post {i // 3}", "ref_text": f"tl;dr {i // 3}", "sample": f"s{i}"} for i in range(9)]
    evals = [{"context": c, "ref_text": "x", "sample": "e"} for c in ("post 9", "post 2", "post 9", "post 10")]
    files = {"train": write_lines(tmp_path / "train.jsonl", train), "eval": write_lines(tmp_path / "eval.jsonl", evals)}
    got = fetch("tldr", {"files": files, "distinct": "context"}, seed=0)
    assert [r["sample"] for r in got.train] == ["s0", "s3", "s6"]
    assert got.origin["train"]["lines"] == [1, 4, 7]
    assert [r["context"] for r in got.eval] == ["post 9", "post 10"]  # post 2 is a train row's
    assert got.origin["eval"]["lines"] == [1, 4]
    # Before a seeded hold-out: the held-out rows are distinct posts, none of them also trained on.
    held = fetch("tldr", {"files": files["train"], "distinct": "context", "eval_size": 0.34}, seed=0)
    assert len(held.train) == 2 and len(held.eval) == 1
    assert {r["context"] for r in held.train} | {r["context"] for r in held.eval} == {"post 0", "post 1", "post 2"}
    with pytest.raises(DataError) as err:
        fetch("tldr", {"files": files, "distinct": "prompt"}, seed=0)
    assert str(err.value) == (f"dataset 'tldr': distinct: column 'prompt' is missing from {files['train']} line 1; "
                              "columns are ['context', 'ref_text', 'sample']")
