import ast
import copy
import functools
import os
from pathlib import Path

import learning
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Workers share the cores: torch's threads of one would spin while the other's run (set before torch loads).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(
        os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


def _tests_taking(fixture: str) -> set[str]:
    """'tests/<file>::<test>' of every test function that takes `fixture`, read from the sources (the
    scheduler below runs in pytest-xdist's controller, which collects nothing)."""
    found = set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    fixture in [a.arg for a in node.args.args]:
                found.add(f"{path.relative_to(ROOT).as_posix()}::{node.name}")
    return found


def _modules_with_module_fixtures() -> set[str]:
    """'tests/<file>' of every test module that defines a module-scoped fixture (built once per worker)."""
    found = set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("pytest.fixture") and any(
                    k.arg == "scope" and ast.unparse(k.value) in ("'module'", '"module"') for k in node.keywords):
                found.add(path.relative_to(ROOT).as_posix())
    return found


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """README's test line runs two pytest-xdist workers (-n 2). Every test of the one real workflow run goes to
    one worker, so that run happens once while the other worker takes the rest; likewise the tests of a module
    with a module-scoped fixture (the 2-process trainings of tests/test_distributed_training.py: 45 s), which
    would otherwise be built on both workers. Every other test is a unit of its own. (xdist's own `loadgroup`
    can't do it under pytest 9: it renames items through an attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":
        return None
    shared, grouped = _tests_taking("workflow_run"), _modules_with_module_fixtures()

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.split("[")[0] in shared:
                return "workflow_run"
            module = nodeid.split("::")[0]
            return module if module in grouped else nodeid

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(items):
    """Slow tests first: the scheduler hands out units in collection order (after the groups of several tests),
    so a test of minutes never starts last while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_setup(item):
    if "workflow_run" not in item.fixturenames:
        load_training_libraries()
    if item.get_closest_marker("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU; none is visible (CI has none: run `pytest -m cuda` on a GPU machine)")


@pytest.fixture(autouse=True)
def _in_project_root(monkeypatch):
    """Config paths (data/samples/...) are relative to the project root, as for Snakemake."""
    monkeypatch.chdir(ROOT)


@pytest.fixture
def config():
    """The default config with the schema's defaults filled, as the Snakefile sees it."""
    from snakemake.utils import validate

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    validate(cfg, str(ROOT / "config" / "schema.yaml"))
    return copy.deepcopy(cfg)


def base_samples():
    """The shipped samples a tiny test model and tokenizer learn from: one file per generator of
    snaketrl.data.samples, not the prompt sets derived from them (arithmetic_carry, arithmetic_mixed), so a new prompt
    set leaves the tiny model, and every threshold measured on it, as it was."""
    from snaketrl.data.samples import GENERATORS

    return sorted(ROOT / "data" / "samples" / f"{name}.jsonl" for name in GENERATORS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2-style model and tokenizer trained on the shipped samples (built once)."""
    from snaketrl.models.tiny import build_tiny_from_files

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    out = tmp_path_factory.mktemp("models") / "qwen2-tiny"
    files = base_samples()
    build_tiny_from_files(cfg["models"]["qwen2-tiny"]["tiny"], files, out, seed=learning.seed(0))
    return out


@pytest.fixture(scope="session")
def reward_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model as a sequence classifier: PPO's reward and value model, its score head fixed on disk."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("reward") / "model"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def workflow_run(tmp_path_factory):
    """The default workflow, run once to completion as users deploy it: a directory of their own holding a copy
    of the default config and a Snakefile that uses this checkout as a module (tests/test_deploy.py). Nothing
    may be written into the checkout."""
    from test_deploy import assert_untouched, checkout_files, user_directory
    from test_workflow import snakemake

    from snaketrl import paths

    before = checkout_files()
    wd = user_directory(tmp_path_factory.mktemp("wf") / "user")
    # Its two jobs at a time yield to the other pytest-xdist worker's tests (niceness 10): while that worker is
    # busy they share one core, and its 2-process tests' ranks, which wait on each other, are not slowed by a
    # third busy process; while it is idle they take both cores. (Measured on 2 cores: one job at a time, the
    # suite 11 min 50 s and the other worker idle at the end; two at niceness 0, 11 min 56 s and 1.5 CPU-minutes
    # more; two at niceness 10, 11 min 22 s.)
    proc = snakemake(wd, paths.report(), nice=10, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_untouched(before)
    return wd


@functools.cache
def load_training_libraries() -> None:
    """Most tests train or load a model in this process: torch, transformers and TRL (a million objects that
    live as long as the process) are imported once, before the first such test, and frozen, so the cyclic
    collector stops walking them after every test's garbage (snaketrl.imports.start_job does the same for a job).
    The tests of the one workflow run need none of them: the worker that runs it starts it without this 8 s of
    imports, and imports them only if other tests come its way."""
    import gc

    # bitsandbytes stays importable, unlike in a job (snaketrl.imports): a test trains a 4-bit policy on its CPU backend.
    import transformers  # noqa: F401
    from trl import SFTTrainer  # noqa: F401

    gc.freeze()

