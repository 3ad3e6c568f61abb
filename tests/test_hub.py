"""Download steps against a local "hub" (no network here), and the token's path."""

import json

import pytest
import snakemake_cli

from snaketrl import paths
from snaketrl.data.fetch import fetch
from snaketrl.hub import HubUnreachable
from snaketrl.models.download import download


def fake_model_repo(root):
    root.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "pytorch_model.bin", "README.md", "optimizer.pt", "modeling_custom.py"):
        (root / name).write_text("{}")
    return root


def test_model_download_copies_only_what_training_needs(tmp_path):
    repo = fake_model_repo(tmp_path / "hub" / "org" / "model")
    download("m", {"hub": str(repo)}, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_remote_code_is_fetched_only_when_the_config_trusts_it(tmp_path):
    repo = fake_model_repo(tmp_path / "hub")
    download("m", {"hub": str(repo), "trust_remote_code": True}, tmp_path / "out")
    assert (tmp_path / "out" / "modeling_custom.py").exists()


def test_model_without_safetensors_is_refused(tmp_path):
    repo = fake_model_repo(tmp_path / "hub")
    (repo / "model.safetensors").unlink()
    with pytest.raises(RuntimeError, match="model 'm': .* has no safetensors weights"):
        download("m", {"hub": str(repo)}, tmp_path / "out")


def test_offline_model_download_names_the_model_and_how_to_prefetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match=r"^model 'qwen': cannot reach the Hugging Face Hub .* to fetch "
                                             r"'Qwen/Qwen2.5-0.5B-Instruct'. On a machine with internet: `hf download "
                                             r"Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`"):
        download("qwen", {"hub": "Qwen/Qwen2.5-0.5B-Instruct"}, tmp_path / "out")


def test_dataset_from_a_local_hub_layout_with_split_slices(tmp_path):
    repo = tmp_path / "hub" / "tldr"
    (repo / "data").mkdir(parents=True)
    for split, n in (("train", 20), ("validation", 10)):
        (repo / "data" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{split} {i}", "completion": str(i)}) + "\n" for i in range(n)))
    got = fetch("tldr", {"hub": str(repo), "split": "train[:5]", "eval_split": "validation[2:4]"}, seed=0)
    assert [r["prompt"] for r in got.train] == [f"train {i}" for i in range(5)]
    assert [r["prompt"] for r in got.eval] == ["validation 2", "validation 3"]


def test_hf_token_unset_parses_and_set_never_reaches_a_log(tmp_path):
    """Dry-run without HF_TOKEN, then a real download job with one set: the token appears nowhere."""
    from test_workflow import copy_project, edit_config, env

    wd = copy_project(tmp_path / "wf")
    repo = fake_model_repo(tmp_path / "hub")
    edit_config(wd, lambda c: c["models"].update(hubby={"hub": str(repo), "lora": {"target_modules": ["q_proj"]}}))
    clean = {k: v for k, v in env().items() if k != "HF_TOKEN"}
    proc = snakemake_cli.run(["-n", "all"], wd, clean, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    secret = "hf_NotARealTokenButSecret123"
    proc = snakemake_cli.run(["--cores", "1", paths.model("hubby")], wd, {**env(), "HF_TOKEN": secret}, 300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert secret not in proc.stdout + proc.stderr
    for path in [*wd.rglob("*.log"), *wd.rglob("*.json")]:
        assert secret not in path.read_text(errors="ignore"), path
