"""The live view (docs/live-view.md): runs that report_to trackio log their curves into the workflow's own trackio
store, one project named for the workdir, each run under its name; trackio's dashboard shows them."""

import copy
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from snaketrl import paths
from snaketrl.config import ConfigError, live_environment, resolve_runs
from snaketrl.train.args import build_args
from snaketrl.trainers import REGISTRY
from test_browser import BROWSER, FLAGS

PROJECT = "live-study"  # the workflow's directory, and so its trackio project
RUNS = {"t-sft": "sft", "t-dpo": "dpo"}

# Reads what trackio stored, in a process of its own: nothing of the training process's trackio is reused.
READ = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
print(json.dumps({"projects": SQLiteStorage.get_projects(), "runs": SQLiteStorage.get_runs(project),
                  "logs": {run: SQLiteStorage.get_logs(project, run) for run in SQLiteStorage.get_runs(project)}}))
"""

# trackio's dashboard on 127.0.0.1 for at most `seconds`, then closed.
SHOW = """
import sys, time
import trackio
app, url, *_ = trackio.show(project=sys.argv[1], open_browser=False, block_thread=False, host="127.0.0.1",
                            share=False, server_port=int(sys.argv[2]))
print("URL", url, flush=True)
time.sleep(float(sys.argv[3]))
app.close()
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A workflow's working directory: its trackio store is results/trackio there. Every test of this module
    trains and reads in it (trackio reads its store's place once per process, on import)."""
    path = tmp_path_factory.mktemp("live") / PROJECT
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def trained(workdir, tiny_model_dir, tmp_path_factory):
    """Two tiny runs of two trainers, both with report_to trackio, trained in the workflow's directory."""
    import yaml
    from snakemake.utils import validate
    from test_trainers import prepare

    from snaketrl.train.run import train_run

    base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    validate(base, str(ROOT / "config" / "schema.yaml"))
    states = {}
    for run, trainer in RUNS.items():
        tmp = tmp_path_factory.mktemp(trainer)
        config = copy.deepcopy(base)
        config["training"]["report_to"] = "trackio"
        os.chdir(ROOT)  # the config's sample files are the checkout's
        job = prepare(tmp, config, tiny_model_dir, trainer)
        # As the Snakefile hands it to the job: the environment, not the run's params.
        environment = live_environment(config, {run: job["run"]})
        assert job["run"]["name"] == run and job["run"]["args"]["report_to"] == "none"
        assert json.loads(environment["SNAKETRL_LIVE"]) == {run: {"report_to": "trackio"}}
        os.chdir(workdir)
        os.environ.update(environment)
        try:
            train_run(**job)
        finally:
            os.chdir(ROOT)
            del os.environ["SNAKETRL_LIVE"]
        states[run] = json.loads((job["out_dir"] / "trainer_state.json").read_text())
    return states


def read_store(store):
    proc = subprocess.run([sys.executable, "-c", READ, PROJECT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRACKIO_DIR": str(store)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def curve(entries, loss: str, step: str) -> list[tuple[int, float]]:
    return [(entry[step], entry[loss]) for entry in entries if loss in entry]


def test_two_runs_log_their_curves_into_the_workflows_trackio_project(trained, workdir):
    store = workdir / paths.trackio()
    assert sorted(p.name for p in store.glob("*.db")) == [f"{PROJECT}.db"]
    seen = read_store(store)
    assert seen["projects"] == [PROJECT]
    assert sorted(seen["runs"]) == sorted(RUNS)
    for run, state in trained.items():
        logged = curve(seen["logs"][run], "train/loss", "train/global_step")
        expected = curve(state["log_history"], "loss", "step")
        assert len(expected) == state["global_step"] == 3  # logging_steps 1, max_steps 3
        assert logged == expected, run
        # The evaluation after training (snaketrl.train.run) is on the same run's curves.
        assert curve(seen["logs"][run], "eval/loss", "train/global_step") == curve(
            state["log_history"], "eval_loss", "step") != [], run


def test_dashboard_shows_the_projects_runs(trained, workdir, tmp_path):
    if BROWSER is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium); .ci/run installs it")
    from snaketrl.train.distributed import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SHOW, PROJECT, str(port), "90"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "TRACKIO_DIR": str(workdir / paths.trackio())})
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            url = line.split()[1] if line.startswith("URL ") else None
        assert url == f"http://127.0.0.1:{port}/", f"no dashboard: {server.poll()}"
        page = f"{url}?project={PROJECT}"
        common = [BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900",
                  "--virtual-time-budget=15000", "--hide-scrollbars"]
        dom = subprocess.run([*common, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
        shot = tmp_path / "live-view.png"
        subprocess.run([*common, f"--screenshot={shot}", page], capture_output=True, timeout=120)
    finally:
        server.terminate()
        server.wait(timeout=30)
    # The page renders in the browser: the project's name, each run in the run list and in the plots' legends.
    assert f'value="{PROJECT}"' in dom or PROJECT in re.sub(r"<[^>]+>", " ", dom), dom[:2000]
    for run in RUNS:
        assert dom.count(run) >= 2, (run, dom[:2000])
    assert ">loss<" in dom
    assert shot.stat().st_size > 20_000


def test_report_to_is_checked_at_parse_time(config):
    def refused(change):
        cfg = copy.deepcopy(config)
        change(cfg)
        with pytest.raises(ConfigError) as err:
            resolve_runs(cfg)
        return str(err.value)

    assert refused(lambda c: c["training"].update(report_to="wandb")) == (
        "config: training.report_to: 'wandb' is not something a run reports to here; expected 'trackio' (a live "
        "view of the runs on this machine: docs/live-view.md) or 'none'")
    assert refused(lambda c: c["trainers"]["dpo"]["args"].update(report_to=["none", "trackio"])) == (
        "config: trainers.dpo.args.report_to: 'none' together with ['trackio']; write one of them")
    assert refused(lambda c: c["trainers"]["dpo"]["args"].update(project="mine")) == (
        "config: trainers.dpo.args.project: one trackio project holds all the workflow's runs; set project "
        "under training")
    assert refused(lambda c: c["training"].update(project="../elsewhere")) == (
        "config: training.project: '../elsewhere': the trackio project names a file in results/trackio; it may hold "
        "only letters, digits, '_', '.', '~', '+', '-', starting with a letter or digit")
    assert refused(lambda c: c["training"].update(trackio_space_id="me/space")) == (
        "config: training.trackio_space_id: set by the live view (report_to: trackio keeps the curves in "
        "results/trackio on this machine: docs/live-view.md); remove it")
    assert refused(lambda c: c["training"].update(run_name="x")).startswith(
        "config: training.run_name: set by the workflow (each run's own name")
    ok = copy.deepcopy(config)
    ok["training"].update(report_to="trackio", project="my-study")
    runs = resolve_runs(ok)
    live = json.loads(live_environment(ok, runs)["SNAKETRL_LIVE"])
    assert sorted(live) == sorted(runs) and all(f == {"report_to": "trackio", "project": "my-study"}
                                                for f in live.values())


def test_turning_the_live_view_on_changes_no_runs_params(config):
    """The view is no part of a result: the resolved runs (the train jobs' params and resume fingerprints) are the
    same with it on or off, so Snakemake retrains nothing; only the environment the jobs get differs."""
    on = copy.deepcopy(config)
    on["training"].update(report_to="trackio", project="my-study")
    on["runs"] = {"sft-qwen2-tiny": {"args": {"report_to": "none"}}}
    assert resolve_runs(on) == resolve_runs(copy.deepcopy(config))
    live = json.loads(live_environment(on, resolve_runs(on))["SNAKETRL_LIVE"])
    assert "sft-qwen2-tiny" not in live and live["dpo-qwen2-tiny"] == {"report_to": "trackio", "project": "my-study"}
    assert json.loads(live_environment(config, resolve_runs(config))["SNAKETRL_LIVE"]) == {}


@pytest.mark.parametrize("trainer", sorted(REGISTRY))
def test_every_trainer_reports_to_trackio_on_this_machine_only(trainer, workdir, monkeypatch, tmp_path):
    """Each trainer's TRL config: the workflow's project (its directory, or training.project), the run's
    name, no Space; trackio's store under results, and a Space or server named in the environment dropped."""
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/space")
    monkeypatch.setenv("TRACKIO_SERVER_URL", "https://example.org")
    monkeypatch.setenv("TRACKIO_DIR", "/elsewhere")
    common = dict(output_dir=str(tmp_path), max_length=64, seed=1, run=f"{trainer}-qwen2-tiny-seed1")
    args = build_args(trainer, {"report_to": "trackio"}, **common)
    assert args.report_to == ["trackio"] and args.project == PROJECT
    assert args.run_name == f"{trainer}-qwen2-tiny-seed1"
    assert args.trackio_space_id is None and args.trackio_static_space_id is False
    assert os.environ["TRACKIO_DIR"] == str(workdir / "results" / "trackio")
    assert "TRACKIO_SPACE_ID" not in os.environ and "TRACKIO_SERVER_URL" not in os.environ
    assert build_args(trainer, {"report_to": "trackio", "project": "my-study"}, **common).project == "my-study"
    quiet = build_args(trainer, {}, **common)
    assert quiet.report_to in ([], ["none"]) and quiet.project != PROJECT


def test_a_job_without_trackio_names_the_package(monkeypatch, workdir, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "trackio" else find_spec(name, *a))
    monkeypatch.chdir(workdir)
    with pytest.raises(ConfigError) as err:
        build_args("sft", {"report_to": "trackio"}, output_dir=str(tmp_path), max_length=64, seed=1, run="sft-x")
    assert str(err.value) == ("config: run 'sft-x': report_to trackio needs the trackio package in the train job's "
                              "environment: pip install trackio (requirements.txt pins its version)")


def test_trackio_is_imported_only_by_a_run_that_reports_to_it():
    """No import of trackio in the train job's code, lazy ones included (test_envs.job_imports): transformers'
    TrackioCallback imports it, in a job whose run reports to it. It costs about half a second."""
    from test_envs import job_imports, third_party

    assert {"trl", "transformers"} <= third_party(job_imports(ROOT / "scripts/train.py"))
    assert "trackio" not in third_party(job_imports(ROOT / "scripts/train.py"))
