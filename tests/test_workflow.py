"""The real workflow, run by Snakemake in a temporary copy of the project."""

import json
import os
import shutil
import subprocess
import sys

import learning
import pytest
import snakemake_cli
import yaml

from conftest import ROOT
from snaketrl import paths
from snaketrl.trainers import REGISTRY

PROJECT = ["Snakefile", "rules", "scripts", "config", "envs", "data", "report"]


def copy_project(dest):
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
    return dest


def env(*paths):
    # The snaketrl package of this checkout, whichever checkout pip installed last.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), str(ROOT)])}


def snakemake(workdir, *args, timeout=900, nice=0):
    """`snakemake --cores 2 *args` in `workdir` (`nice`: added to its niceness, which its jobs inherit)."""
    return snakemake_cli.run(["--cores", "2", *args], workdir, env(), timeout, nice)


def edit_config(workdir, change):
    path = workdir / "config" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    change(cfg)
    path.write_text(yaml.safe_dump(cfg))


@pytest.mark.slow
def test_report_lists_every_run(workflow_run):
    html = (workflow_run / paths.report()).read_text()
    for run in [f"{t}-{m}" for t in ("sft", "dpo", "reward", "grpo", "ppo") for m in ("qwen2-tiny", "pythia-tiny")]:
        assert f'id="{run}"' in html
        assert f"<th>{run}</th>" in html
        # What decides the run's rounding, from its manifest (two runs that differ only there are explained).
        numerics = json.loads((workflow_run / paths.run_file(run, "manifest.json")).read_text())["numerics"]
        assert f"cpu_capability {numerics['cpu_capability']}, " in html and numerics["dtype"] == "float32"


@pytest.mark.slow
def test_every_run_logged_losses_and_trained_with_histogram_max_length(workflow_run):
    for state_file in sorted(workflow_run.glob(paths.run_file("*", "trainer_state.json"))):
        run = state_file.parent.name
        state = json.loads(state_file.read_text())
        assert len(state["log_history"]) >= 3, run
        manifest = json.loads((state_file.parent / "manifest.json").read_text())
        trainer, model, dataset = (manifest["config"][k] for k in ("trainer", "model", "dataset"))
        lengths = json.loads((workflow_run / paths.lengths(trainer, dataset, model)).read_text())
        spec = REGISTRY[trainer]
        if spec.length_field:
            assert manifest["trl_args"][spec.length_field] == lengths["max_length"], run
        if spec.tokenized:
            prompts = [json.loads(x) for x in (workflow_run / paths.tokenized(dataset, trainer, model, "train"))
                       .read_text().splitlines()]
            assert max(len(p["input_ids"]) for p in prompts) <= lengths["max_length"]
        metrics = json.loads((state_file.parent / "metrics.json").read_text())
        # the train rule's mem_mb (8000 at the first attempt) reached the plan: its room is at most that, less weights
        assert 0 < metrics["memory_limit_bytes"] <= 8000 * 10 ** 6, run
        assert metrics["checkpointing_room_bytes"] < 0.6 * metrics["memory_limit_bytes"], run
        for check in learning.WORKFLOW[trainer]:
            learning.check(run, check, state, metrics, manifest["seed"])
    assert len(list(workflow_run.glob(paths.run_file("*", "trainer_state.json")))) == 10


@pytest.mark.slow
def test_tiny_bases_are_pretrained_well_below_a_uniform_guess(workflow_run):
    import math

    for model in ("qwen2-tiny", "pythia-tiny"):
        metrics = json.loads((workflow_run / paths.pretrain_file(model, "metrics.json")).read_text())
        assert metrics["ln_vocab"] == pytest.approx(math.log(1024), abs=0.01)
        state = json.loads((workflow_run / paths.pretrain_file(model, "trainer_state.json")).read_text())
        learning.check(model, learning.WORKFLOW["pretrain"][0], state, metrics, "config")
        assert len(metrics["sample"].split()) >= 5, metrics["sample"]


@pytest.mark.slow
def test_rerun_is_a_no_op(workflow_run):
    proc = snakemake(workflow_run, "-n", paths.report())
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_dry_run_never_imports_torch_transformers_or_trl(tmp_path):
    wd = copy_project(tmp_path / "wf")
    trap = tmp_path / "trap"
    for name in ("torch", "transformers", "trl"):
        (trap / name).mkdir(parents=True)
        (trap / name / "__init__.py").write_text(f"raise ImportError('{name} imported while parsing')\n")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet", "all"], cwd=wd, capture_output=True,
                          text=True, env=env(trap))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("change, message", [
    (lambda c: c["trainers"].update(ppx={"dataset": "tldr"}),
     "snaketrl: config: trainers.ppx: unknown trainer; expected one of"),
    (lambda c: c["runs"].update(extra={"trainer": "sft", "model": "nope"}),
     "snaketrl: config: runs.extra.model: unknown model 'nope'"),
    (lambda c: c["runs"].update(extra={"trainer": "sft", "model": "qwen2-tiny", "dataset": "nope"}),
     "snaketrl: config: runs.extra.dataset: unknown dataset 'nope'"),
    (lambda c: c["length"].update(round_to="big"), "snaketrl: config: length.round_to: 'big' is not of type 'integer'"),
    (lambda c: c["trainers"]["grpo"].update(reward_funcs=["lenght"]),
     "reward_funcs: unknown reward function 'lenght'"),
    (lambda c: c["datasets"]["tldr"].update(files="data/samples/missing.jsonl"),
     "snaketrl: config: datasets.tldr.files: train file data/samples/missing.jsonl does not exist"),
    (lambda c: c["models"]["qwen2-tiny"]["tiny"].update(corpus=["data/nope.txt"]),
     "snaketrl: config: models.qwen2-tiny.tiny.corpus: 'data/nope.txt' is neither a dataset of this config "
     "(arithmetic, descriptiveness, firefly, tldr, ultrafeedback) nor an existing .jsonl/.txt file"),
    (lambda c: c["trainers"]["grpo"]["args"].update(num_generations=3),
     "generation batch 16 (per_device_train_batch_size x steps_per_generation) is not divisible by num_generations=3"),
    # Once named only in the train job, after the tiny models were built and pretrained.
    (lambda c: c["trainers"]["sft"]["args"].update(learning_rat=0.1),
     "snaketrl: config: trainers.sft.args.learning_rat: not a field of trl.SFTConfig; did you mean 'learning_rate'?"),
])
def test_bad_config_fails_at_parse_time(tmp_path, change, message):
    wd = copy_project(tmp_path / "wf")
    edit_config(wd, change)
    proc = snakemake(wd, "-n", paths.report(), timeout=60)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.mark.parametrize("change, target, message, absent", [
    (lambda c: c["trainers"]["sft"].update(dataset="firefly") or c["datasets"]["firefly"].update(columns={}),
     paths.prepared("firefly", "sft", "train"),
     "dataset 'firefly': trainer 'sft' needs columns (prompt, completion) or (messages) or (text); missing "
     "'prompt'; columns are ['kind', 'input', 'target']",
     paths.prepared("firefly", "sft", "train")),
])
def test_bad_input_fails_with_one_line_and_leaves_no_output(tmp_path, change, target, message, absent):
    wd = copy_project(tmp_path / "wf")
    edit_config(wd, change)
    proc = snakemake(wd, target, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert not (wd / absent).exists()


@pytest.mark.slow
def test_a_lora_target_the_model_lacks_fails_its_job_in_one_line_and_leaves_no_output(workflow_run, tmp_path):
    """A copy of the finished run with the LoRA target edited: only the edited run's train job reruns, on the
    pretrained model it already has, and fails as the model loads."""
    wd = shutil.copytree(workflow_run, tmp_path / "user", symlinks=True)  # as deep: the module's path is relative
    edit_config(wd, lambda c: c["models"]["qwen2-tiny"]["lora"].update(target_modules=["query_key_value"]))
    weights = wd / paths.model("qwen2-tiny") / "model.safetensors"
    built = weights.stat().st_mtime_ns
    proc = snakemake(wd, paths.run_file("sft-qwen2-tiny", "trainer_state.json"), timeout=300)
    assert proc.returncode != 0
    assert "models.qwen2-tiny.lora.target_modules: ['query_key_value'] not in the model (Qwen2ForCausalLM)" \
        in proc.stderr, proc.stderr[-3000:]
    assert not (wd / paths.adapter("sft-qwen2-tiny")).exists()
    assert weights.stat().st_mtime_ns == built  # the pretrained base was not rebuilt


def test_ppo_waits_for_its_reward_model_in_the_dag(tmp_path):
    wd = copy_project(tmp_path / "wf")
    proc = snakemake(wd, "-n", "--forceall", paths.run_file("ppo-qwen2-tiny", "trainer_state.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # The reward run is trained and merged before PPO, and PPO's job takes the merged reward model as input.
    assert "wildcards: run=reward-qwen2-tiny" in out
    ppo_job = out[out.index("wildcards: run=ppo-qwen2-tiny") - 1500:out.index("wildcards: run=ppo-qwen2-tiny")]
    assert paths.merged("reward-qwen2-tiny") in ppo_job.rsplit("rule train", 1)[1]
    dag = snakemake(wd, "--dag", "--forceall", paths.run_file("ppo-qwen2-tiny", "trainer_state.json"), timeout=60).stdout
    assert "merge" in dag and "run: reward-qwen2-tiny" in dag


def test_ppo_can_start_from_the_sft_runs_merged_adapter(tmp_path):
    wd = copy_project(tmp_path / "wf")
    edit_config(wd, lambda c: c["trainers"]["ppo"].update(policy="sft-{model}"))
    proc = snakemake(wd, "-n", "--forceall", paths.run_file("ppo-pythia-tiny", "trainer_state.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ppo_job = proc.stdout[:proc.stdout.index("wildcards: run=ppo-pythia-tiny")].rsplit("rule train", 1)[1]
    assert paths.merged("sft-pythia-tiny") in ppo_job
    assert paths.merged("reward-pythia-tiny") in ppo_job


def test_three_seeds_triple_the_training_jobs_and_keep_one_report(tmp_path):
    wd = copy_project(tmp_path / "wf")

    def counts(*args):
        proc = snakemake(wd, "-n", "--quiet", "rules", *args, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        table = proc.stdout[proc.stdout.index("job "):proc.stdout.index("total")]
        return {k: int(v) for k, v in (line.split() for line in table.splitlines()[2:] if line.strip())}

    one = counts()
    edit_config(wd, lambda c: c.update(seeds=[1, 2, 3]))
    three = counts()
    assert three["train"] == 3 * one["train"] and three["plot_run"] == 3 * one["plot_run"]
    assert three["report"] == one["report"] == 1
    assert three["pretrain"] == one["pretrain"] and three["get_dataset"] == one["get_dataset"]


@pytest.mark.slow
def test_leaderboard_and_database_hold_every_base_and_run(workflow_run):
    import sqlite3

    cfg = yaml.safe_load((workflow_run / "config/config.yaml").read_text())
    html = (workflow_run / paths.report()).read_text()
    board = html[html.index("leaderboard"):html.index("Completions side by side")]
    runs = [f"{t}-{m}" for t in ("sft", "dpo", "grpo", "ppo") for m in cfg["matrix"]["models"]]
    for name in [*runs, *(f"base-{m}" for m in cfg["matrix"]["models"])]:
        assert f"<th>{name}</th>" in board, name
    n_prompts = cfg["evaluation"]["prompts"]["size"]
    with sqlite3.connect(workflow_run / paths.evaluation_db()) as con:
        per_run = dict(con.execute("SELECT run, COUNT(*) FROM completions GROUP BY run").fetchall())
        assert per_run == {name: n_prompts for name in [*runs, *(f"base-{m}" for m in cfg["matrix"]["models"])]}
        metrics = {r[0] for r in con.execute("SELECT run FROM metrics")}
        assert metrics == set(per_run)
        assert con.execute("SELECT COUNT(*) FROM training_samples WHERE run LIKE 'grpo-%'").fetchone()[0] > 0
