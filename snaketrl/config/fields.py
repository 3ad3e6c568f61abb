"""The init fields of a TRL (or peft) config class, with their types, read from the installed sources
without importing them.

Parsing the Snakefile must not import trl (it loads torch and transformers), yet a misspelt or mistyped
field should fail then, not in the tenth training job. The config classes are plain dataclasses, so their
fields are the annotated assignments of the class and its bases; the imports that lead to each class
(trl's lazy `__init__`s keep theirs under `if TYPE_CHECKING:`) are followed statically, and so are the
enums an annotation names (`IntervalStrategy | str`: transformers converts the string to the enum).
tests/test_trl_fields.py checks the result against `dataclasses.fields` of the imported classes.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

# Annotation names -> the kind of value they take; None: anything (typing.Any).
SIMPLE = {"int": "int", "float": "float", "bool": "bool", "str": "str", "None": "none", "NoneType": "none",
          "dict": "dict", "Dict": "dict", "list": "list", "List": "list", "tuple": "list", "Tuple": "list",
          "Any": None}


class Field(NamedTuple):
    """What a field takes. `types`: kinds of values ("int", "float", "bool", "str", "none", "dict", "list"),
    None when the annotation does not say (anything goes); `values`: the only strings (and literals) it takes
    besides `types` (an enum's values, a Literal's, the `choices` of its metadata)."""
    types: frozenset[str] | None
    values: tuple = ()


def init_fields(dotted: str) -> frozenset[str] | None:
    """Init field names of "module:Class" (a snaketrl.trainers entry), or None when its source cannot be
    read statically (the package is not installed where Snakemake parses, or a base is out of reach):
    then the training job's own check (snaketrl.train.args.check_args) is the only one."""
    found = init_field_types(dotted)
    return None if found is None else frozenset(found)


@functools.lru_cache(maxsize=None)
def init_field_types(dotted: str) -> dict[str, Field] | None:
    """Init field name -> Field of "module:Class", or None as for init_fields. Read once per installation:
    parsing transformers' and trl's sources takes a tenth of a second, so the result is kept on disk (see
    _cached) for as long as every source it was read from is unchanged."""
    cached = _cached(dotted)
    if cached is not None:
        return cached
    module, _, name = dotted.partition(":")
    _read.clear()
    try:
        fields = _class_fields(module, name, frozenset())
        if fields is None:
            return None
        found = {f: _field(*where) for f, (init, *where) in fields.items() if init}
    except (OSError, SyntaxError, ValueError):
        return None
    _store(dotted, found, sorted(_read))
    return found


# Modules whose sources the class being read was read from (_source records them): what its cache entry
# depends on.
_read: set[str] = set()


def _cache_file() -> Path:
    """One file per Python installation: entries of another one would only be read again and replaced."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "snaketrl" / f"config-fields-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]}.json"


@functools.lru_cache(maxsize=1)
def _cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _stamp(module: str) -> list | None:
    """[module, file, mtime_ns, size] of the file the module is now found at (None: not found)."""
    try:
        spec = __spec__ if module == __name__ else _spec(module)
        stat = os.stat(spec.origin)
    except (AttributeError, ImportError, OSError, TypeError, ValueError):
        return None
    return [module, spec.origin, stat.st_mtime_ns, stat.st_size]


def _cached(dotted: str) -> dict[str, Field] | None:
    """The stored fields of `dotted`, if every module they were read from is found at the same, unchanged
    file (this module included: a change of how fields are read rereads them)."""
    entry = _cache().get(dotted)
    if not entry or any(_stamp(stamp[0]) != stamp for stamp in entry["read"]):
        return None
    return {name: Field(None if types is None else frozenset(types), tuple(values))
            for name, (types, values) in entry["fields"].items()}


def _store(dotted: str, fields: dict[str, Field], modules: list[str]) -> None:
    stamps = [_stamp(m) for m in [__name__, *modules]]
    if None in stamps:
        return
    _cache()[dotted] = {"read": stamps, "fields": {
        name: [None if f.types is None else sorted(f.types), list(f.values)] for name, f in fields.items()}}
    path = _cache_file()
    try:  # a read-only home only costs the next parse the reading
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_cache()))
        os.replace(tmp, path)
    except OSError:
        pass


@functools.lru_cache(maxsize=None)
def _spec(module: str):
    """A module's spec, found as the import system would find it (no parent package runs), or None."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    for i, part in enumerate(rest):
        if spec is None or not spec.submodule_search_locations:
            return None
        # str(): an imported lazy module (transformers) may list Path objects, which PathFinder skips.
        spec = importlib.machinery.PathFinder.find_spec(".".join([top, *rest[:i + 1]]),
                                                        [str(p) for p in spec.submodule_search_locations])
    return spec


def _source(module: str) -> tuple[Path, ast.Module] | None:
    """A module's file and syntax tree, found as the import system would find it, but not run."""
    found = _parsed(module)
    if found is not None:
        _read.add(module)
    return found


@functools.lru_cache(maxsize=None)
def _parsed(module: str) -> tuple[Path, ast.Module] | None:
    found = module_source(module)
    return None if found is None or found[1] is None else found


def module_source(module: str) -> tuple[Path, ast.Module | None] | None:
    """A module's file and its syntax tree (None for a compiled or namespace module), found as the import system
    would find it but not run; None when there is no such module."""
    try:
        spec = _spec(module)
    except (ImportError, ValueError):  # find_spec of a top-level module that is half set up
        return None
    if spec is None:
        return None
    if not spec.origin or not spec.origin.endswith(".py"):
        where = spec.origin or next(iter(spec.submodule_search_locations or []), module)
        return Path(where), None
    path = Path(spec.origin)
    return path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def top_level_names(tree: ast.Module | None) -> set[str] | None:
    """The names a module defines when it runs (functions, classes, assignments, imports; inside top-level
    if/try blocks too), or None when its source cannot tell (compiled, `import *`, a module `__getattr__`)."""
    if tree is None:
        return None
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return None if "__getattr__" in names else names


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


def _class_def(module: str, name: str, seen: frozenset = frozenset()) -> tuple[str, ast.ClassDef] | None:
    """The module that defines the class `name` as module `module` exposes it, and its definition."""
    if (module, name) in seen:
        return None
    seen = seen | {(module, name)}
    found = _source(module)
    if found is None:
        return None
    tree = found[1]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in ast.walk(tree):  # re-exported: follow the import (under TYPE_CHECKING in lazy modules)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _class_def(_absolute(module, node), alias.name, seen)
    return None


def _class_fields(module: str, name: str, seen: frozenset) -> dict[str, tuple] | None:
    """Field name -> (init, defining module, its AnnAssign), bases first, for the class `name` as module
    `module` exposes it."""
    found = _class_def(module, name)
    if found is None or found in seen:
        return None
    return _fields_of(found[0], found[1], seen | {found})


def _fields_of(module: str, cls: ast.ClassDef, seen: frozenset) -> dict[str, tuple] | None:
    fields: dict[str, tuple] = {}
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
        fields[node.target.id] = (not _init_false(node.value), module, node)
    return fields


def _field(module: str, node: ast.AnnAssign) -> Field:
    kinds = _kinds(module, node.annotation)
    if kinds is None:
        return Field(None)
    types, values = kinds
    if "enum" in types:  # `SomeEnum | str`: transformers converts the string with the enum, so only its values
        types = types - {"enum", "str"}
    choices = _metadata_choices(node.value)
    if choices and "str" in types:  # `str` with `choices`: only those (transformers' argparse metadata)
        types, values = types - {"str"}, (*values, *choices)
    return Field(frozenset(types), tuple(dict.fromkeys(values)))


def _kinds(module: str, node) -> tuple[set[str], tuple] | None:
    """(kinds of values, the literal values besides) an annotation admits; None: anything (or unknown)."""
    if isinstance(node, ast.Constant):
        if node.value is None:
            return {"none"}, ()
        if isinstance(node.value, str):  # a string annotation: `"int | None"`
            return _kinds(module, ast.parse(node.value, mode="eval").body)
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_kinds(module, node.left), _kinds(module, node.right)])
    if isinstance(node, ast.Subscript):
        head = _name(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return _union([_kinds(module, args[0]), ({"none"}, ())])
        if head == "Union":
            return _union([_kinds(module, a) for a in args])
        if head == "Literal":
            values = tuple(ast.literal_eval(a) for a in args)
            # A Literal that stands for a pattern ('pissa_niter_[number of iters]') takes any string.
            return ({"str"} if any("[" in str(v) for v in values) else set()), values
        return ({SIMPLE[head]}, ()) if SIMPLE.get(head) else None
    name = _name(node)
    if name in SIMPLE:
        return ({SIMPLE[name]}, ()) if SIMPLE[name] else None
    values = _enum_values(module, name) if name else None
    return ({"enum"}, values) if values else None


def _union(parts: list) -> tuple[set[str], tuple] | None:
    if any(p is None for p in parts):
        return None
    types, values = set(), ()
    for t, v in parts:
        types |= t
        values += v
    return types, values


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # typing.Optional, trainer_utils.IntervalStrategy
        return node.attr
    return None


def _enum_values(module: str, name: str) -> tuple[str, ...] | None:
    """The string values of an Enum class that `module` names `name` (its `MEMBER = "value"` lines)."""
    found = _class_def(module, name)
    if found is None or not any((_name(b) or "").endswith("Enum") for b in found[1].bases):
        return None
    return tuple(node.value.value for node in found[1].body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)) or None


def _metadata_choices(value) -> tuple | None:
    """`field(..., metadata={"choices": [...]})` with a literal list."""
    if not isinstance(value, ast.Call):
        return None
    for k in value.keywords:
        if k.arg == "metadata" and isinstance(k.value, ast.Dict):
            for key, item in zip(k.value.keys, k.value.values):
                if isinstance(key, ast.Constant) and key.value == "choices":
                    try:
                        return tuple(ast.literal_eval(item))
                    except ValueError:
                        return None  # computed (`trainer_log_levels.keys()`): not checked
    return None


def _init_false(value) -> bool:
    """`field(..., init=False)`."""
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords)
