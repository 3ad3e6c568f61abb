"""docs/configuration-reference.md is generated from config/schema.yaml and must match it."""

import copy

import pytest

from snaketrl.config import reference

SCHEMA = reference.load()


def test_the_reference_page_is_the_one_the_schema_generates():
    assert reference.PAGE.read_text() == reference.page(SCHEMA), "rewrite it: python -m snaketrl.config.reference"


def test_every_schema_key_has_a_short_one_line_description():
    assert reference.missing_descriptions(SCHEMA) == []
    long = {row["key"]: len(row["description"].split()) for row in reference.rows(SCHEMA)
            if len(row["description"].split()) > 30}
    assert long == {}, "a reference cell is one line: longer explanations go to docs/configuration.md"


def test_a_key_without_a_description_is_named_and_the_cli_refuses_it(tmp_path, monkeypatch, capsys):
    schema = copy.deepcopy(SCHEMA)
    del schema["properties"]["evaluation"]["properties"]["lm_eval"]["properties"]["limit"]["description"]
    assert reference.missing_descriptions(schema) == ["evaluation.lm_eval.limit"]
    monkeypatch.setattr(reference, "load", lambda: schema)
    monkeypatch.setattr(reference, "PAGE", tmp_path / "reference.md")
    assert reference.main([]) == 1
    assert "keys without a description: evaluation.lm_eval.limit" in capsys.readouterr().err
    assert not (tmp_path / "reference.md").exists()


def test_check_fails_on_a_stale_page_and_passes_once_rewritten(tmp_path, monkeypatch, capsys):
    page = tmp_path / "reference.md"
    page.write_text(reference.PAGE.read_text().replace("| `seed` | integer | `42` |", "| `seed` | integer | `7` |"))
    monkeypatch.setattr(reference, "PAGE", page)
    assert reference.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert reference.main([]) == 0
    assert reference.main(["--check"]) == 0
    assert page.read_text() == reference.page(SCHEMA)


@pytest.mark.parametrize("key, type_, default", [
    ("seed", "integer", "`42`"),
    ("lora", "object", "`{r: 16, lora_alpha: 32, lora_dropout: 0.05}`"),
    ("models.<model>.tiny.vocab_size", "integer", "`1024`"),
    ("models.<model>.tiny.pretrain.steps", "integer", "`300`"),
    ("models.<model>.tiny.model_type", "string", "required"),
    ("datasets.<dataset>.revision", "string or null", "`null`"),
    ("datasets.<dataset>.eval_size", "number", "`0.1`"),
    ("datasets.<dataset>.files.train", "string", "required"),
    ("runs.<run>.reward_funcs", "array", "-"),
    ("runs.<run>.policy", "string or null", "-"),
    ("runs.<run>.processes", "integer", "-"),
    ("evaluation.batch_size", "integer", "`16`"),
    ("evaluation.generation.max_new_tokens", "integer", "`64`"),
    ("evaluation.lm_eval.num_fewshot", "integer or null", "`null`"),
    ("evaluation.prompts", "null or string or object", "-"),
    ("evaluation.pairs.size", "integer or null", "-"),
    ("length.batching", "one of auto, padded, grouped, packed or mapping to one of auto, padded, grouped, packed",
     "`auto`"),
])
def test_the_page_gives_each_keys_type_and_default_as_the_schema_does(key, type_, default):
    line = next(line for line in reference.PAGE.read_text().splitlines() if line.startswith(f"| `{key}` |"))
    assert line.split(" | ")[1:3] == [type_, default]


def test_every_key_the_schema_allows_is_a_row():
    keys = [row["key"] for row in reference.rows(SCHEMA)]
    assert len(keys) == len(set(keys))
    # Keys reached through a $ref ($defs) and through a oneOf branch are listed under each path that allows them.
    for key in ["trainers.<trainer>.max_tokens", "runs.<run>.max_tokens", "evaluation.references.split",
                "datasets.<dataset>.files.eval", "models.<model>.gguf.sha256", "sweeps"]:
        assert key in keys
    top = [k for k in keys if "." not in k]
    assert top == list(SCHEMA["properties"])
