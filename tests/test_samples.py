import json

from conftest import ROOT
from snaketrl.data.samples import GENERATORS, write_samples


def test_shipped_samples_are_what_the_generator_writes(tmp_path):
    for path in write_samples(tmp_path):
        assert path.read_bytes() == (ROOT / "data" / "samples" / path.name).read_bytes(), path.name


def test_samples_have_the_hub_schemas(tmp_path):
    rows = {p.stem: [json.loads(x) for x in p.read_text().splitlines()] for p in write_samples(tmp_path, n=50)}
    assert set(rows) == set(GENERATORS)
    assert set(rows["tldr"][0]) == {"prompt", "completion"}
    assert rows["tldr"][0]["prompt"].endswith("TL;DR:")
    assert set(rows["ultrafeedback"][0]) == {"chosen", "rejected", "score_chosen", "score_rejected"}
    assert [m["role"] for m in rows["ultrafeedback"][0]["chosen"]] == ["user", "assistant"]
    assert set(rows["descriptiveness"][0]) == {"prompt", "chosen", "rejected"}
    assert set(rows["firefly"][0]) == {"kind", "input", "target"}
    assert all(len(r) == 50 for r in rows.values())


def test_tldr_completion_restates_the_post(tmp_path):
    # The learnable signal: every word of the summary's subject appears in the post.
    for row in json.loads("[" + ",".join((ROOT / "data/samples/tldr.jsonl").read_text().splitlines()) + "]"):
        name = row["completion"].split()[0]
        assert name in row["prompt"]
