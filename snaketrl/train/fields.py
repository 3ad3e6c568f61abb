"""The init fields of a TRL config class, read from the installed sources without importing them.

Parsing the Snakefile must not import trl (it loads torch and transformers), yet a misspelt swept key
should fail then, not in the tenth training job. The config classes are plain dataclasses, so their
fields are the annotated assignments of the class and its bases; the imports that lead to each class
(trl's lazy `__init__`s keep theirs under `if TYPE_CHECKING:`) are followed statically.
tests/test_trl_fields.py checks the result against `dataclasses.fields` of the imported classes.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
from pathlib import Path


def init_fields(dotted: str) -> frozenset[str] | None:
    """Init field names of "module:Class" (a snaketrl.trainers entry), or None when its source cannot be
    read statically (the package is not installed where Snakemake parses, or a base is out of reach):
    then the training job's own check (snaketrl.train.args.check_args) is the only one."""
    module, _, name = dotted.partition(":")
    try:
        fields = _class_fields(module, name, frozenset())
    except (OSError, SyntaxError, ValueError):
        return None
    return None if fields is None else frozenset(f for f, init in fields.items() if init)


@functools.lru_cache(maxsize=None)
def _source(module: str) -> tuple[Path, ast.Module] | None:
    """A module's file and syntax tree, found as the import system would find it, but not run."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    for i, part in enumerate(rest):
        if spec is None or not spec.submodule_search_locations:
            return None
        # str(): an imported lazy module (transformers) may list Path objects, which PathFinder skips.
        spec = importlib.machinery.PathFinder.find_spec(".".join([top, *rest[:i + 1]]),
                                                        [str(p) for p in spec.submodule_search_locations])
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin)
    return path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _is_package(module: str) -> bool:
    found = _source(module)
    return found is not None and found[0].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _class_fields(module: str, name: str, seen: frozenset) -> dict[str, bool] | None:
    """Field name -> init, bases first, for the class `name` as module `module` exposes it."""
    if (module, name) in seen:
        return None
    seen = seen | {(module, name)}
    found = _source(module)
    if found is None:
        return None
    tree = found[1]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return _fields_of(module, node, seen)
    for node in ast.walk(tree):  # re-exported: follow the import (under TYPE_CHECKING in lazy modules)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _class_fields(_absolute(module, node), alias.name, seen)
    return None


def _fields_of(module: str, cls: ast.ClassDef, seen: frozenset) -> dict[str, bool] | None:
    fields: dict[str, bool] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id == "object":
            continue
        if not isinstance(base, ast.Name):
            return None
        inherited = _class_fields(module, base.id, seen)
        if inherited is None:
            return None
        fields.update(inherited)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(node.annotation):
            continue
        fields[node.target.id] = not _init_false(node.value)
    return fields


def _init_false(value) -> bool:
    """`field(..., init=False)`."""
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords)
