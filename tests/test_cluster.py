"""The seed matrix offline, the SLURM profile, and the launched processes' entry point (the SLURM run itself is in
.ci/slurm.sh; multi-GPU launching in test_distributed.py)."""

import subprocess
import sys

import yaml
from test_workflow import copy_project, env

from conftest import ROOT

NO_NETWORK = '''
import socket
def _refuse(*args, **kwargs):
    raise RuntimeError("network used while building the DAG")
socket.socket.connect = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
'''


def test_seed_matrix_dry_run_lists_every_job_without_network(tmp_path):
    wd = copy_project(tmp_path / "wf")
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NO_NETWORK)  # loaded by every Python process started below
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", "config/seed.yaml"], cwd=wd,
                          env=env(guard), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    counts = dict(line.split() for line in out[out.index("job "):out.index("total")].splitlines()[2:] if line.strip())
    assert counts == {"download_model": "3", "get_dataset": "4", "preprocess": "7", "length_histogram": "7",
                      "tokenize_prompts": "1", "train": "7", "merge": "1", "plot_run": "7", "report": "1", "all": "1"}
    for run in ("sft-qwen2.5-0.5b", "dpo-qwen2.5-0.5b", "grpo-qwen2.5-0.5b", "reward-pythia-160m", "ppo-pythia-1b"):
        assert f"wildcards: run={run}" in out
    # The default config's tiny models are not merged in: --configfile replaces it.
    assert "qwen2-tiny" not in out


def test_seed_config_reproduces_the_seed_document():
    seed = yaml.safe_load((ROOT / "config/seed.yaml").read_text())
    assert {m["hub"] for m in seed["models"].values()} == {
        "Qwen/Qwen2.5-0.5B-Instruct", "EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-160m"}
    assert seed["datasets"]["tldr"]["split"] == "train[:500]"
    assert seed["datasets"]["tldr"]["eval_split"] == "validation[500:600]"
    assert seed["datasets"]["descriptiveness"]["split"] == "descriptiveness[:500]"
    assert seed["models"]["pythia-1b"]["lora"]["target_modules"] == ["query_key_value"]
    assert seed["models"]["qwen2.5-0.5b"]["quantization"] == "4bit"


def test_slurm_profile_keeps_cluster_settings_out_of_rules():
    profile = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    assert profile["executor"] == "slurm" and profile["retries"] >= 1 and profile["slurm-requeue"] is True
    train = profile["set-resources"]["train"]
    assert train["gpu"] == 1 and "cpus_per_gpu" in train
    assert "attempt" in str(train["mem_mb"]) and "attempt" in str(train["runtime"])
    assert not (ROOT / "profiles/default").exists()  # Snakemake would load it for every laptop run
    rules = "".join(p.read_text() for p in (ROOT / "rules").glob("*.smk"))
    assert "slurm_partition" not in rules and "slurm_account" not in rules


def test_slurm_profile_asks_for_the_cpus_its_jobs_use():
    """The SLURM plugin asks for cpus_per_task where a job has it, else cpus_per_gpu per GPU, else the job's
    threads: a default cpus_per_task would give a job of 8 threads fewer CPUs."""
    profile = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    assert "cpus_per_task" not in profile["default-resources"]
    threads = profile["set-threads"]
    assert {"train", "evaluate", "merge"} <= set(threads)
    for rule, resources in profile["set-resources"].items():
        assert "cpus_per_task" not in resources, rule
    assert profile["set-resources"]["train"]["cpus_per_gpu"] == threads["train"]


def test_ci_profile_is_derived_from_the_slurm_profile(tmp_path):
    subprocess.run([sys.executable, str(ROOT / ".ci/derive_profile.py"), str(ROOT / "profiles/slurm/config.yaml"),
                    str(tmp_path / "config.yaml")], check=True, capture_output=True)
    derived = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert derived["slurm-status-command"] == "squeue" and derived["slurm-no-account"] is True
    assert "gpu" not in derived["set-resources"]["train"]
    assert derived["retries"] >= 1 and derived["executor"] == "slurm"


def test_train_module_entry_point_reads_a_job_file(tmp_path, monkeypatch):
    import json

    import snaketrl.train.run as train

    seen = {}
    monkeypatch.setattr(train, "train_run", lambda **kw: seen.update(kw))
    (tmp_path / "job.json").write_text(json.dumps({"run": {"name": "r"}, "out_dir": "o"}))
    train.main([str(tmp_path / "job.json")])
    assert seen == {"run": {"name": "r"}, "out_dir": "o"}
