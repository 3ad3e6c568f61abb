"""The real workflow, run by Snakemake in a temporary copy of the project."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT

PROJECT = ["Snakefile", "rules", "scripts", "config", "envs", "data", "report"]


def copy_project(dest):
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
    return dest


def snakemake(workdir, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir,
                          capture_output=True, text=True, timeout=timeout)


def edit_config(workdir, change):
    path = workdir / "config" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    change(cfg)
    path.write_text(yaml.safe_dump(cfg))


@pytest.fixture(scope="module")
def workflow_run(tmp_path_factory):
    wd = copy_project(tmp_path_factory.mktemp("wf"))
    proc = snakemake(wd, "results/report.html")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return wd


@pytest.mark.slow
def test_report_lists_every_run(workflow_run):
    html = (workflow_run / "results/report.html").read_text()
    for run in ["sft-qwen2-tiny", "sft-pythia-tiny", "dpo-qwen2-tiny", "dpo-pythia-tiny"]:
        assert f'id="{run}"' in html
        assert f"<th>{run}</th>" in html


@pytest.mark.slow
def test_every_run_logged_losses_and_trained_with_histogram_max_length(workflow_run):
    for state_file in sorted((workflow_run / "results/runs").glob("*/trainer_state.json")):
        run = state_file.parent.name
        state = json.loads(state_file.read_text())
        losses = [e["loss"] for e in state["log_history"] if "loss" in e]
        assert len(losses) >= 3, run
        manifest = json.loads((state_file.parent / "manifest.json").read_text())
        trainer, model, dataset = (manifest["config"][k] for k in ("trainer", "model", "dataset"))
        lengths = json.loads((workflow_run / f"results/lengths/{trainer}/{dataset}/{model}.json").read_text())
        assert manifest["trl_args"]["max_length"] == lengths["max_length"], run
        if trainer == "sft":
            assert losses[-1] < losses[0], (run, losses)
        if trainer == "dpo":
            accuracies = [e["rewards/accuracies"] for e in state["log_history"] if "rewards/accuracies" in e]
            assert accuracies and accuracies[-1] > 0.5, (run, accuracies)
    assert len(list((workflow_run / "results/runs").glob("*/trainer_state.json"))) == 4


@pytest.mark.slow
def test_rerun_is_a_no_op(workflow_run):
    proc = snakemake(workflow_run, "-n", "results/report.html")
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_dry_run_never_imports_torch_transformers_or_trl(tmp_path):
    wd = copy_project(tmp_path / "wf")
    trap = tmp_path / "trap"
    for name in ("torch", "transformers", "trl"):
        (trap / name).mkdir(parents=True)
        (trap / name / "__init__.py").write_text(f"raise ImportError('{name} imported while parsing')\n")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet", "all"], cwd=wd, capture_output=True,
                          text=True, env={**__import__("os").environ, "PYTHONPATH": str(trap)})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("change, message", [
    (lambda c: c["trainers"].update(ppx={"dataset": "tldr"}),
     "snaketrl: config: trainers.ppx: unknown trainer; expected one of"),
    (lambda c: c["runs"].update(extra={"trainer": "sft", "model": "nope"}),
     "snaketrl: config: runs.extra.model: unknown model 'nope'"),
    (lambda c: c["runs"].update(extra={"trainer": "sft", "model": "qwen2-tiny", "dataset": "nope"}),
     "snaketrl: config: runs.extra.dataset: unknown dataset 'nope'"),
    (lambda c: c["length"].update(round_to="big"), "'big' is not of type 'integer'"),
])
def test_bad_config_fails_at_parse_time(tmp_path, change, message):
    wd = copy_project(tmp_path / "wf")
    edit_config(wd, change)
    proc = snakemake(wd, "-n", "results/report.html", timeout=60)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.mark.parametrize("change, target, message, absent", [
    (lambda c: c["datasets"]["tldr"].update(files="data/samples/missing.jsonl"),
     "results/datasets/tldr/sft/train.jsonl",
     "dataset 'tldr': file data/samples/missing.jsonl does not exist",
     "results/datasets/tldr/raw/train.jsonl"),
    (lambda c: c["trainers"]["sft"].update(dataset="firefly") or c["datasets"]["firefly"].update(columns={}),
     "results/datasets/firefly/sft/train.jsonl",
     "dataset 'firefly': trainer 'sft' needs columns (prompt, completion) or (messages) or (text); missing "
     "'prompt'; columns are ['kind', 'input', 'target']",
     "results/datasets/firefly/sft/train.jsonl"),
    (lambda c: c["training"].update(learning_rat=0.1), "results/runs/sft-qwen2-tiny/trainer_state.json",
     "'learning_rat' is not a field of trl.SFTConfig; did you mean 'learning_rate'?",
     "results/runs/sft-qwen2-tiny/adapter"),
    (lambda c: c["models"]["qwen2-tiny"]["lora"].update(target_modules=["query_key_value"]),
     "results/runs/sft-qwen2-tiny/trainer_state.json",
     "models.qwen2-tiny.lora.target_modules: ['query_key_value'] not in the model (Qwen2ForCausalLM)",
     "results/runs/sft-qwen2-tiny/adapter"),
])
def test_bad_input_fails_with_one_line_and_leaves_no_output(tmp_path, change, target, message, absent):
    wd = copy_project(tmp_path / "wf")
    edit_config(wd, change)
    proc = snakemake(wd, target, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert not (wd / absent).exists()
