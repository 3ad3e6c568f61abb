"""TRL config fields read statically (parse time) agree with the imported classes."""

import dataclasses
import subprocess
import sys

import pytest

from conftest import ROOT
from snaketrl.config.fields import Field, init_field_types, init_fields
from snaketrl.trainers import REGISTRY, load


def test_static_fields_equal_the_dataclass_fields_of_every_trainer():
    for trainer, spec in REGISTRY.items():
        cls = load(spec.config)
        assert init_fields(spec.config) == {f.name for f in dataclasses.fields(cls) if f.init}, trainer


def test_an_unreadable_class_gives_none_not_a_guess():
    assert init_fields("trl:NoSuchConfig") is None
    assert init_fields("no_such_package.sub:Config") is None


def test_checking_a_sweep_imports_no_torch():
    code = ("import sys, yaml; from snakemake.utils import validate; from snaketrl.config import resolve_runs; "
            "c = yaml.safe_load(open('config/config.yaml')); "
            "c['sweeps'] = {'ppo': {'kl_coef': [0.01, 0.1]}, 'dpo': {'beta': [0.1, 0.2]}}; "
            "validate(c, 'config/schema.yaml'); runs = resolve_runs(c); assert 'ppo-qwen2-tiny-kl_coef~0.1' in runs; "
            "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]; assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_static_types_agree_with_the_annotations_and_enums():
    import enum
    import types
    import typing

    simple = {int: "int", float: "float", bool: "bool", str: "str", type(None): "none"}
    checked = 0
    for trainer, spec in [*REGISTRY.items(), ("lora", type("Spec", (), {"config": "peft:LoraConfig"}))]:
        static = init_field_types(spec.config)
        for f in dataclasses.fields(load(spec.config)):
            if not f.init:
                continue
            hint = typing.get_type_hints(load(spec.config))[f.name]
            args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is \
                typing.Union else (hint,)
            enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
            if all(a in simple for a in args) and "choices" not in f.metadata:
                assert static[f.name] == Field(frozenset(simple[a] for a in args)), (trainer, f.name)
                checked += 1
            elif enums and set(args) <= {*enums, str, type(None)}:
                assert set(static[f.name].values) == {e.value for e in enums[0]}, (trainer, f.name)
                assert "str" not in static[f.name].types, (trainer, f.name)  # transformers converts to the enum
                checked += 1
            elif isinstance(f.metadata.get("choices"), list):
                assert static[f.name].values == tuple(f.metadata["choices"]), (trainer, f.name)
                checked += 1
    assert checked > 1000


def test_fields_are_read_once_then_from_disk_until_a_source_changes(tmp_path, monkeypatch):
    import json

    from snaketrl.config import fields

    def fresh():
        for cached in (fields.init_field_types, fields._cache, fields._parsed, fields._spec):
            cached.cache_clear()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fresh()
    read = fields.init_field_types("trl:DPOConfig")
    stored = json.loads(fields._cache_file().read_text())["trl:DPOConfig"]
    modules = [stamp[0] for stamp in stored["read"]]
    assert {"snaketrl.config.fields", "trl.trainer.dpo_config", "transformers.training_args",
            "transformers.trainer_utils"} <= set(modules)

    def no_parsing(module):
        raise AssertionError(f"{module} parsed again")

    fresh()
    with monkeypatch.context() as m:
        m.setattr(fields, "module_source", no_parsing)
        assert fields.init_field_types("trl:DPOConfig") == read

    stored["read"][modules.index("transformers.training_args")][2] -= 1  # as if the file had changed since
    fields._cache_file().write_text(json.dumps({"trl:DPOConfig": stored}))
    fresh()
    with monkeypatch.context() as m:
        m.setattr(fields, "module_source", no_parsing)
        with pytest.raises(AssertionError, match="parsed again"):
            fields.init_field_types("trl:DPOConfig")
    fresh()
    assert fields.init_field_types("trl:DPOConfig") == read
    fresh()
