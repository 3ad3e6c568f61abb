"""TRL config fields read statically (parse time) agree with the imported classes."""

import dataclasses
import subprocess
import sys

from conftest import ROOT
from snaketrl.train.fields import init_fields
from snaketrl.trainers import REGISTRY, load


def test_static_fields_equal_the_dataclass_fields_of_every_trainer():
    for trainer, spec in REGISTRY.items():
        cls = load(spec.config)
        assert init_fields(spec.config) == {f.name for f in dataclasses.fields(cls) if f.init}, trainer


def test_an_unreadable_class_gives_none_not_a_guess():
    assert init_fields("trl:NoSuchConfig") is None
    assert init_fields("no_such_package.sub:Config") is None


def test_checking_a_sweep_imports_no_torch():
    code = ("import sys, yaml; from snakemake.utils import validate; from snaketrl.config import check; "
            "c = yaml.safe_load(open('config/config.yaml')); "
            "c['sweeps'] = {'ppo': {'kl_coef': [0.01, 0.1]}, 'dpo': {'beta': [0.1, 0.2]}}; "
            "validate(c, 'config/schema.yaml'); runs = check(c); assert 'ppo-qwen2-tiny-kl_coef~0.1' in runs; "
            "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]; assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
