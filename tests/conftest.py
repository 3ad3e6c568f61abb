import copy
from pathlib import Path

import learning
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    # README's test line runs two pytest-xdist workers (--dist loadgroup): the tests of the one real workflow
    # run share a worker, so that run happens once while the other worker takes the rest.
    for item in items:
        if "workflow_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("workflow"))


def pytest_runtest_setup(item):
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2-style model and tokenizer trained on the shipped samples (built once)."""
    from snaketrl.models.tiny import build_tiny_from_files

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    out = tmp_path_factory.mktemp("models") / "qwen2-tiny"
    files = sorted((ROOT / "data" / "samples").glob("*.jsonl"))
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
    """The default workflow, run once to completion in a temporary copy of the project."""
    from test_workflow import copy_project, snakemake

    from snaketrl import paths

    wd = copy_project(tmp_path_factory.mktemp("wf"))
    proc = snakemake(wd, paths.report())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return wd
