"""Deployed the way Snakemake users deploy workflows: run from any working directory (`-d`), and used as a module
by a directory of the user's own (config/config.yaml and workflow/Snakefile, the layout snakedeploy writes).
What ships with the workflow is read from the checkout; results land in the user's directory, and nothing is
written into the checkout."""

import json
import os
import re
import shutil
import subprocess

import pytest
import snakemake_cli
import yaml
from test_dryrun import job_counts
from test_workflow import copy_project, env, snakemake

from conftest import ROOT
from snaketrl import paths

MODULE = '''configfile: "config/config.yaml"


module snaketrl:
    snakefile:
        "{snakefile}"
    config:
        config


use rule * from snaketrl
'''


def user_directory(path, config=None, snakefile=None):
    """A user's deployment: a copy of the default config (or `config`) and a Snakefile that uses this checkout
    as a module, by a path relative to the Snakefile (an absolute one is a lint warning)."""
    (path / "config").mkdir(parents=True)
    (path / "workflow").mkdir()
    if config is None:
        shutil.copy(ROOT / "config" / "config.yaml", path / "config" / "config.yaml")
    else:
        (path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    snakefile = snakefile or f'"{os.path.relpath(ROOT / "Snakefile", path / "workflow")}"'
    (path / "workflow" / "Snakefile").write_text(MODULE.replace('"{snakefile}"', snakefile))
    return path


def checkout_files():
    """Every file of the checkout with its modification time, but what Python and git write themselves."""
    skip = {".git", "__pycache__", ".pytest_cache"}
    out = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = os.path.join(top, name)
            out[os.path.relpath(path, ROOT)] = os.stat(path).st_mtime_ns
    return out


def assert_untouched(before):
    """The checkout holds the files of `before` (checkout_files()), none of them changed."""
    after = checkout_files()
    assert sorted(after.keys() ^ before.keys()) == [], "files written into (or removed from) the checkout"
    assert [k for k in after if after[k] != before[k]] == [], "files of the checkout changed"


@pytest.fixture
def untouched_checkout():
    """Fails the test if it wrote into the checkout (a results/ or .snakemake/ of its own, an edited file)."""
    before = checkout_files()
    yield
    assert_untouched(before)


@pytest.fixture(scope="module")
def in_clone_counts(tmp_path_factory):
    """The default's jobs as planned inside a clone, from its root: what every deployment must plan."""
    counts = job_counts(copy_project(tmp_path_factory.mktemp("clone")))
    assert counts["train"] == 10 and counts["evaluate"] == 10, counts
    return counts


def test_any_working_directory_runs_the_default(tmp_path, in_clone_counts, untouched_checkout):
    """`snakemake -d <empty dir> -s <clone>/Snakefile`, no --configfile: the shipped default config, its sample
    data and accelerate configs are found in the checkout."""
    (tmp_path / "cwd").mkdir()
    counts = job_counts(tmp_path / "cwd", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "work"))
    assert counts == in_clone_counts
    assert (tmp_path / "work" / ".snakemake").is_dir()  # Snakemake's own records: in the working directory


def test_a_module_of_the_users_workflow_runs_the_default(tmp_path, in_clone_counts, untouched_checkout):
    user = user_directory(tmp_path / "user")
    assert job_counts(user) == in_clone_counts
    proc = snakemake_cli.run(["--lint"], user, env(), 120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_renamed_rules_keep_the_default_target(tmp_path, in_clone_counts):
    """`use rule * from snaketrl as snaketrl_*`, as a user with rules of their own writes: `snaketrl_all`
    (default_target) still plans every job."""
    user = user_directory(tmp_path / "user")
    snakefile = user / "workflow" / "Snakefile"
    snakefile.write_text(snakefile.read_text().replace("from snaketrl\n", "from snaketrl as snaketrl_*\n"))
    assert job_counts(user) == {f"snaketrl_{rule}": n for rule, n in in_clone_counts.items()}


def test_a_copy_of_the_default_config_names_the_shipped_files_from_anywhere(tmp_path, untouched_checkout):
    """The train job reads the checkout's accelerate config, get_dataset the checkout's sample, the eval job
    the lm-eval task's data file: absolute paths, the same from every working directory."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["models"]["qwen2-tiny"]["tiny"]["corpus"].append("workflow:data/samples/firefly.jsonl")  # a shipped file
    user = user_directory(tmp_path / "user", cfg)
    proc = snakemake(user, "-n", "--forceall", paths.report(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for block in re.split(r"\n(?:local)?rule ", proc.stdout)[1:]:
        lines = dict(line.strip().split(": ", 1) for line in block.splitlines()[1:] if ": " in line)
        jobs[(block.split(":")[0], lines.get("wildcards"))] = lines.get("input", "").split(", ")
    assert f"{ROOT}/config/accelerate/ddp.yaml" in jobs[("train", "run=sft-qwen2-tiny")]
    assert jobs[("get_dataset", "dataset=tldr")] == [f"{ROOT}/data/samples/tldr.jsonl"]
    assert f"{ROOT}/data/samples/arithmetic.jsonl" in jobs[("evaluate", "evaluated=sft-qwen2-tiny")]
    assert f"{ROOT}/data/samples/firefly.jsonl" in jobs[("tiny_model", "model=qwen2-tiny")]


def test_a_relative_path_stays_the_users(tmp_path):
    """A path without `workflow:` is the user's, relative to the working directory, as Snakemake reads every
    relative path; the error says where it was looked for, and how to name the shipped file instead."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["datasets"]["tldr"]["files"] = "data/samples/tldr.jsonl"
    user = user_directory(tmp_path / "user", cfg)
    proc = snakemake(user, "-n", timeout=120)
    assert proc.returncode != 0
    assert (f"snaketrl: config: datasets.tldr.files: train file data/samples/tldr.jsonl does not exist (relative "
            f"paths are read from the working directory, {user}; the workflow ships data/samples/tldr.jsonl: write "
            f"workflow:data/samples/tldr.jsonl)") in proc.stderr
    (user / "data").mkdir()
    shutil.copytree(ROOT / "data" / "samples", user / "data" / "samples")
    proc = snakemake(user, "-n", "--forceall", paths.raw("tldr", "train"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "input: data/samples/tldr.jsonl\n" in proc.stdout


def test_a_remote_module_is_refused_at_parse_time_in_one_line(tmp_path):
    """Snakemake copies a git or hosted module's files one at a time, as text: no sample directory, no link to
    the package for the jobs. A gitfile() module stands in for github() here (no network)."""
    repo = copy_project(tmp_path / "repo")
    git = ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", "-C", str(repo)]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "snaketrl"], ["tag", "v0"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    user = user_directory(tmp_path / "user", snakefile=f'gitfile("{repo}", path="Snakefile", tag="v0")')
    proc = snakemake(user, "-n", timeout=120)
    assert proc.returncode != 0
    assert (f"snaketrl: used as a module from git+file://{repo}/@v0, which is not a local directory; git clone the "
            f"repository at that version and set the module's snakefile: to the clone's Snakefile") in proc.stderr


def test_snakedeploy_from_a_local_clone_plans_the_default_after_the_readme_fix(tmp_path, in_clone_counts,
                                                                             untouched_checkout):
    """docs/deploy.md's snakedeploy steps with the clone as the source, pinned to a commit (no tags exist):
    snakedeploy copies config/ and writes a module whose `snakefile: "Snakefile"` resolves next to
    workflow/Snakefile (itself); the one line the page says to replace points it at the clone, and the
    deployment then plans the clone's jobs."""
    user = tmp_path / "my-project"
    commit = "0" * 40  # from a local path snakedeploy ignores it: the clone's checkout is what runs
    steps = (ROOT / "docs/deploy.md").read_text()
    assert "snakedeploy deploy-workflow ./snaketrl my-project --commit <commit>" in steps
    proc = subprocess.run([shutil.which("snakedeploy"), "deploy-workflow", str(ROOT), str(user), "--commit", commit],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (user / "config" / "config.yaml").read_text() == (ROOT / "config" / "config.yaml").read_text()
    snakefile = user / "workflow" / "Snakefile"
    written = snakefile.read_text()
    assert re.search(r'snakefile:\s*\n\s*"Snakefile"\n', written), written
    clone = os.path.relpath(ROOT / "Snakefile", snakefile.parent)
    snakefile.write_text(re.sub(r'(snakefile:\s*\n\s*)"Snakefile"', rf'\1"{clone}"', written))
    assert job_counts(user) == in_clone_counts


@pytest.mark.slow
def test_a_module_runs_end_to_end_in_the_users_directory(workflow_run, tmp_path):
    """The one real workflow run (conftest.workflow_run) is such a deployment: results in the user's directory,
    the checkout untouched (the fixture checks), and the shipped lm-eval task's data read from the checkout."""
    user = workflow_run
    assert (user / paths.report()).is_file()
    assert (user / paths.run_file("sft-qwen2-tiny", "trainer_state.json")).is_file()
    limit = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["evaluation"]["lm_eval"]["limit"]
    metrics = json.loads((user / paths.evaluation("sft-qwen2-tiny", "metrics.json")).read_text())
    assert metrics["lm_eval"]["snaketrl_arithmetic"]["sample_len"] == limit
    assert "Nothing to be done" in snakemake(user, "-n", timeout=120).stdout

    # Params and inputs do not depend on where the user's directory is, nor on how the workflow is run:
    # moved elsewhere (as deep: the module's path is relative), or run with -s/-d and the same config,
    # nothing is out of date. The directory moves back for the run's other tests.
    moved = shutil.move(user, tmp_path / "moved")
    try:
        proc = snakemake(moved, "-n", timeout=120)
        assert "Nothing to be done" in proc.stdout, proc.stdout[-3000:]
        proc = snakemake(tmp_path, "-n", "-s", str(ROOT / "Snakefile"), "-d", str(moved), "--configfile",
                         str(moved / "config" / "config.yaml"), timeout=120)
        assert "Nothing to be done" in proc.stdout, proc.stdout[-3000:]
    finally:
        shutil.move(moved, user)


def test_catalog_files_describe_every_top_level_key_and_the_usage():
    """The workflow catalog shows config/README.md as the workflow's configuration and reads its usage from
    .snakemake-workflow-catalog.yml: every key the schema allows is described, each in one table row."""
    schema = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())
    readme = (ROOT / "config" / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in readme.splitlines() if line.startswith("| `")}
    optional = {key for key in schema["properties"] if f"`{key}`" in readme}
    assert set(yaml.safe_load((ROOT / "config" / "config.yaml").read_text())) <= rows
    assert set(schema["properties"]) == rows | optional
    assert "workflow:data/samples/" in readme
    usage = yaml.safe_load((ROOT / ".snakemake-workflow-catalog.yml").read_text())["usage"]
    assert set(usage) == {"mandatory-flags", "software-stack-deployment", "report"}
    assert set(usage["mandatory-flags"]) == {"desc", "flags"} and usage["software-stack-deployment"]["conda"]
