"""The package is laid out like the DAG: a stage imports only the shared core and the stages before it.

Imports are read from the source (function-level ones included, since those are what the jobs run), so a
lazy import that climbs back up a stage, or closes a circle, fails here before it confuses a reader.
"""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "snaketrl"
# Lower number, lower in the picture. The core (errors, io, paths, manifest, hub, smk, the trainer registry, the
# reward functions and the divergence scan) is what every stage shares; the config sits on top: it checks every
# stage's settings at parse time, so it reads their declarative parts, and no stage reads it (jobs get their config
# as params).
LAYERS = {"core": 0, "data": 1, "models": 2, "train": 3, "evaluate": 4, "report": 5, "config": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "core"


def imports() -> dict[str, set[str]]:
    """Module -> the snaketrl modules it imports (a `from package import name` of a submodule counts as it)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("snaketrl.")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "snaketrl":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        graph[name] = {m for m in found if m != name and m != "snaketrl"}
    return graph


def test_every_import_goes_down_a_stage_or_stays_in_its_own():
    up = [f"{src} -> {dst}" for src, dsts in imports().items() for dst in dsts
          if layer(dst) != layer(src) and LAYERS[layer(dst)] > LAYERS[layer(src)]]
    assert not up, f"imports that run back up the stages: {up}"


def test_no_import_circle():
    graph = imports()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_layers_are_the_rule_files():
    stages = {p.stem for p in (ROOT / "rules").glob("*.smk")} - {"common"}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert stages <= packages, f"rule files without a package: {sorted(stages - packages)}"
    assert packages <= set(LAYERS), f"packages outside the layer picture: {sorted(packages - set(LAYERS))}"


def test_collecting_the_tests_imports_no_training_library():
    """Each pytest worker imports every test module before its first test. torch, transformers, TRL or peft imported
    at a test module's top level (directly or through snaketrl.train) cost each worker about 10 s there, and the
    worker that runs the workflow starts it that much later."""
    import subprocess
    import sys

    modules = sorted(path.stem for path in (ROOT / "tests").glob("test_*.py"))
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest; " + "; ".join(f"import {m}" for m in modules)
            + "; print(sorted(m for m in ('peft', 'torch', 'transformers', 'trl') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore belongs to its module: another module that needs it needs a public one."""
    crossing = [f"{module_name(path)} imports {node.module}.{alias.name}" for path in PACKAGE.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("snaketrl")
                for alias in node.names if alias.name.startswith("_") and not alias.name.endswith("__")]
    assert not crossing, crossing


def test_a_package_init_only_hands_names_on():
    """Each package's __init__ is a face: its docstring, imports and __all__; its logic lives in named modules."""
    logic = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in PACKAGE.rglob("__init__.py")
             for node in ast.parse(path.read_text()).body
             if not isinstance(node, (ast.Import, ast.ImportFrom))
             and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
             and not (isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)]
                      in (["__all__"], ["__version__"]))]
    assert not logic, f"logic in a package face: {logic}"
