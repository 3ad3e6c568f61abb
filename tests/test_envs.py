"""The conda envs as `snakemake --software-deployment-method conda` uses them.

Each rule's env comes from the `conda:`/`script:` pairs in rules/*.smk; what a job imports comes from
its script and the snaketrl code the script reaches, lazy imports inside functions included.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

PKG = "snaketrl"
# Tools of the submitting side: a job that needs one is a mistake in its env.
NOT_IN_JOBS = {"pytest", "snakemake", "snakemake-executor-plugin-slurm", "snakedeploy"}


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+!]+)", line)
            assert match, f"not an exact pin: {line!r}"
            pins[_name(match[1])] = match[2]
    return pins


def env_spec(path: Path) -> tuple[list, list[str]]:
    spec = yaml.safe_load(path.read_text())
    pip = [d["pip"] for d in spec["dependencies"] if isinstance(d, dict)]
    return spec, (pip[0] if pip else [])


def rule_envs(rules_dir: Path = ROOT / "rules") -> dict[str, tuple[Path, Path]]:
    """Rule -> (env file, script), both resolved as Snakemake does: relative to the .smk file."""
    out = {}
    for smk in sorted(rules_dir.glob("*.smk")):
        blocks = re.split(r"^(?:rule|checkpoint)\s+(\w+)\s*:", smk.read_text(), flags=re.M)
        for name, body in zip(blocks[1::2], blocks[2::2]):
            body = re.split(r"^\S", body, maxsplit=1, flags=re.M)[0]  # up to the next top-level statement
            found = {key: re.search(rf"^\s+{key}:\s*\n?\s*(['\"])(.+?)\1", body, flags=re.M)
                     for key in ("conda", "script")}
            if found["script"] is None:
                continue
            assert found["conda"], f"rule {name} ({smk.name}) runs a script but names no `conda:` env file"
            out[name] = tuple((smk.parent / found[key][2]).resolve() for key in ("conda", "script"))
    assert out, f"no rule with a script in {rules_dir}"
    return out


def env_scripts() -> dict[Path, list[Path]]:
    envs = {}
    for rule, (env, script) in rule_envs().items():
        assert env.is_file(), f"rule {rule} names {env}, which does not exist"
        envs.setdefault(env, []).append(script)
    return {env: sorted(set(scripts)) for env, scripts in envs.items()}


# Imports by name at run time, which no import statement shows: (module, function) -> statements.
def _dynamic() -> dict[tuple[str, str], list[str]]:
    from snaketrl.trainers import MODEL_CLASSES, REGISTRY

    trl = sorted({"from {} import {}".format(*dotted.split(":"))
                  for spec in REGISTRY.values() for dotted in (spec.config, spec.trainer)})
    auto = [f"from transformers import {cls}" for cls in sorted(set(MODEL_CLASSES.values()))]
    return {("snaketrl.trainers", "load"): trl, ("snaketrl.train.loading", "load_model"): auto,
            ("snaketrl.models.merge", "merge"): auto}


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def job_imports(script: Path) -> list[str]:
    """The import statements a job can run: its script's, those of every snaketrl module it imports, and
    those inside the snaketrl functions, classes and constants it reaches by name (lazy imports included)."""
    statements, loaded, reached, trees, dynamic = [], set(), set(), {}, _dynamic()

    def tree(module):
        if module not in trees:
            trees[module] = ast.parse(_module_file(module).read_text())
        return trees[module]

    def top_level(module):
        names = {}
        for node in tree(module).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names[target.id] = node
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PKG:
                names.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
        return names

    def resolve(module, name):
        if name and _module_file(f"{module}.{name}"):  # from snaketrl import hub
            return f"{module}.{name}", None
        return module, name

    def load(module):
        """Importing a module runs its packages' and its own top level (not the functions' bodies)."""
        parts = module.split(".")
        for mod in (".".join(parts[:depth]) for depth in range(1, len(parts) + 1)):
            if mod not in loaded:
                loaded.add(mod)
                for node in tree(mod).body:
                    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not (
                            isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)):
                        scan(node, mod, top=True)

    def reach(module, name):
        """`name` of `module` is used (None: the module as a whole)."""
        load(module)
        if (module, name) in reached:
            return
        reached.add((module, name))
        statements.extend(s for s in dynamic.get((module, name), []) if s not in statements)
        node = tree(module) if name is None else top_level(module).get(name)
        if node is not None:
            scan(node, module)

    def scan(node, module, top=False):
        """Record the imports under `node` and follow the snaketrl names it uses. A top-level import only
        loads its module: an imported name counts once a function reached uses it."""
        local = top_level(module) if module else {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                targets = [(alias.name, None) for alias in sub.names]
            elif isinstance(sub, ast.ImportFrom) and not sub.level and sub.module != "__future__":
                targets = [(sub.module, alias.name) for alias in sub.names]
            else:
                if module and isinstance(sub, ast.Name) and sub.id in local:
                    found = local[sub.id]
                    reach(*resolve(*found)) if isinstance(found, tuple) else reach(module, sub.id)
                continue
            if ast.unparse(sub) not in statements:
                statements.append(ast.unparse(sub))
            for mod, name in targets:
                if mod.split(".")[0] == PKG:
                    mod, name = resolve(mod, name)
                    load(mod) if top else reach(mod, name)

    scan(ast.parse(script.read_text()), None)
    return statements


def third_party(statements: list[str]) -> set[str]:
    """Top-level modules, not the standard library's nor snaketrl."""
    tops = set()
    for text in statements:
        node = ast.parse(text).body[0]
        names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        tops |= {n.split(".")[0] for n in names}
    return {t for t in tops if t != PKG and t not in sys.stdlib_module_names}


ENVS = sorted((ROOT / "envs").glob("*.yaml"))


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_env_pins_exactly_what_requirements_pin(env):
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    spec, pip = env_spec(env)
    assert spec["channels"] == ["conda-forge", "nodefaults"]
    conda = [d for d in spec["dependencies"] if not isinstance(d, dict)]
    assert sorted(conda) == ["pip", "python=3.11"], "python pinned; everything else through pip, as requirements.txt"
    # An editable/path entry would resolve from .snakemake/conda/, where Snakemake copies the file.
    assert not [line for line in pip if line.lstrip().startswith("-") or "/" in line], "no path-dependent entries"
    pins = _pins(pip)
    assert pins, env.name
    assert {p: v for p, v in pins.items() if req.get(p) != v} == {}, "versions differ from requirements.txt"
    assert not NOT_IN_JOBS & set(pins), "a job env installs a submitting-side tool"


def test_every_script_rule_uses_an_env_that_exists():
    mapping = rule_envs()
    missing = {rule: str(env.relative_to(ROOT)) for rule, (env, _) in mapping.items() if env not in ENVS}
    assert missing == {}, "rules name env files that envs/ does not have"
    assert [s for _, s in mapping.values() if not s.is_file()] == []
    assert set(ENVS) <= {env for env, _ in mapping.values()}, "an env file no rule uses"


# Imported only behind a switch whose check names the package to install first (snaketrl.train.args.check_hardware:
# use_liger_kernel without liger-kernel fails before any model loads): GPU-only, so in no env.
OPTIONAL = {"liger_kernel"}


def test_each_env_pins_every_package_its_scripts_import():
    modules = metadata.packages_distributions()
    for env, scripts in env_scripts().items():
        pins = _pins(env_spec(env)[1])
        for script in scripts:
            imported = {_name(modules.get(m, [m])[0]) for m in third_party(job_imports(script)) - OPTIONAL}
            assert imported - set(pins) == set(), f"{script.name} imports packages {env.name} lacks"


def test_job_imports_follow_lazy_imports_into_snaketrl():
    assert {"datasets"} <= third_party(job_imports(ROOT / "scripts/get_dataset.py"))
    # trl: a chat template cloned from another model's tokenizer (snaketrl.models.chat_template)
    assert {"huggingface_hub", "gguf", "packaging", "torch", "transformers", "trl"} == third_party(
        job_imports(ROOT / "scripts/download_model.py"))
    assert {"torch", "trl", "peft", "datasets"} <= third_party(job_imports(ROOT / "scripts/train.py"))
    assert "torch" not in third_party(job_imports(ROOT / "scripts/length_histogram.py"))


def test_scripts_find_the_package_through_a_relative_link():
    # Snakemake's script preamble appends the script's directory (scripts/) to the job's sys.path.
    link = ROOT / "scripts" / PKG
    assert link.is_symlink() and os.readlink(link) == f"../{PKG}" and link.resolve() == ROOT / PKG
    if (ROOT / ".git").exists() and shutil.which("git"):
        entry = subprocess.run(["git", "ls-files", "-s", f"scripts/{PKG}"], cwd=ROOT, capture_output=True,
                               text=True).stdout
        assert entry.startswith("120000 "), "scripts/snaketrl must be committed as a symlink"


def test_launched_children_find_the_package_without_the_preamble(monkeypatch):
    import snaketrl
    from snaketrl.train.distributed import Plan, launch_env

    gpus = Plan(2, gpu=True)
    home = str(Path(snaketrl.__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != home])
    assert launch_env(gpus, 1, "ddp", {"PYTHONPATH": "/elsewhere"})["PYTHONPATH"] == os.pathsep.join([home, "/elsewhere"])
    monkeypatch.setattr(sys, "path", [home, *sys.path])
    assert launch_env(gpus, 1, "ddp", {}) == {"OMP_NUM_THREADS": "1"}


def _preamble(script: Path, shim: Path) -> str:
    """Snakemake's own preamble for `script`, its fallback search path narrowed to Snakemake's packages
    (the real one appends all of the submitting Python's sys.path, which would hide a missing package)."""
    import snakemake.script as sms
    from snakemake.iocontainers import InputFiles, Log, OutputFiles, Params, ResourceList, Wildcards
    from snakemake.sourcecache import infer_source_file

    real = sms.get_snakemake_searchpaths
    sms.get_snakemake_searchpaths = lambda: [str(shim)]
    try:
        return sms.PythonScript.generate_preamble(
            path=infer_source_file(str(script)), cache_path=None, source="", basedir=str(ROOT),
            input_=InputFiles(), output=OutputFiles(), params=Params(), wildcards=Wildcards(), threads=1,
            resources=ResourceList(), log=Log(), config={}, rulename=script.stem, conda_env="/conda/env",
            container_img=None, singularity_args=None, env_modules=None, bench_record=None, jobid=1,
            bench_iteration=None, cleanup_scripts=True, shadow_dir=None, is_local=True)
    finally:
        sms.get_snakemake_searchpaths = real


CHECK = """
import json, sys
failed = []
for statement in {statements!r}:
    try:
        exec(statement, {{}})
    except Exception as err:
        failed.append(f"{{statement}}: {{type(err).__name__}}: {{err}}")
import snaketrl
print(json.dumps({{"failed": failed, "snaketrl": snaketrl.__file__, "rule": snakemake.rule}}))
"""


# pip's package sources as uv options: uv reads no pip configuration, and a machine's index, mirror or local
# wheels (a CPU build of torch, say) are part of what `pip install` would take there.
PIP_SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
               "constraint": "--constraint"}


def pip_sources(listed: str | None = None) -> list[str]:
    """uv's options for the sources in `pip config list`'s output (this Python's pip, unless given)."""
    if listed is None:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                check=True).stdout
    options, seen = [], set()
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name == "no-index" and ast.literal_eval(value).lower() in ("1", "true", "yes", "on"):
            options.append("--no-index")
        for item in ast.literal_eval(value).split() if name in PIP_SOURCES else []:
            if (PIP_SOURCES[name], item) not in seen:  # pip lists a source once per place that sets it
                seen.add((PIP_SOURCES[name], item))
                options += [PIP_SOURCES[name], item]
    # pip takes the best matching version across all its indexes; uv's default stops at the first that has any
    return options + ["--index-strategy", "unsafe-best-match"]


def test_pip_sources_become_uv_options():
    listed = ("global.cert='/etc/ssl/certs/ca.crt'\n:env:.find-links='/wheels'\nglobal.constraint='/etc/c.txt'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\nglobal.find-links='/wheels'\n")
    assert pip_sources(listed) == ["--find-links", "/wheels", "--constraint", "/etc/c.txt", "--extra-index-url",
                                   "file:///a/simple", "--extra-index-url", "file:///b/simple",
                                   "--index-strategy", "unsafe-best-match"]
    assert pip_sources("global.no-index='true'\n") == ["--no-index", "--index-strategy", "unsafe-best-match"]


@pytest.mark.slow
@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_env_installs_and_runs_its_scripts_imports(env, tmp_path):
    """conda's pip step in a fresh venv (no system packages), then each script's imports behind the
    preamble, with PYTHONPATH unset as Snakemake does for conda jobs. uv installs the env's pip lines from
    pip's own sources with pip's choice among indexes: the same packages as pip, the train env in 46 s where
    pip took 92 (pip unpacks 1.6 GB of wheels in one thread). Its cache stays on, and it leaves bytecode to the imports."""
    spec, pip = env_spec(env)
    if f"python={sys.version_info.major}.{sys.version_info.minor}" not in spec["dependencies"]:
        pytest.skip(f"{env.name} pins another Python than this one")
    # Bytecode may be written (into the throwaway venv): each later script then imports faster.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    # As under Snakemake: the file copied elsewhere, pip run next to the copy on a requirements file.
    (tmp_path / "hash.yaml").write_text(env.read_text())
    (tmp_path / "condaenv.requirements.txt").write_text("\n".join(pip) + "\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=clean)
    python = venv / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", str(python),
                           *pip_sources(), "-r", "condaenv.requirements.txt"],
                          cwd=tmp_path, env=clean, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    site = next((venv / "lib").glob("python*/site-packages"))
    assert not (site / "snakemake").exists() and not (site / PKG).exists()

    # Snakemake's packages, as the preamble's fallback finds them in the submitting Python.
    import snakemake

    shim = tmp_path / "snakemake-searchpath"
    shim.mkdir()
    for pkg in Path(snakemake.__file__).parents[1].glob("snakemake*"):
        if pkg.is_dir() and not pkg.name.endswith("-info"):
            (shim / pkg.name).symlink_to(pkg)
    jobs, workdir = tmp_path / "jobs", tmp_path / "workdir"
    jobs.mkdir()
    workdir.mkdir()
    # One process runs every script's preamble and imports in turn: each import statement is tried on its own,
    # so a package the env lacks fails that statement whatever ran before, and the env's heavy imports (torch,
    # transformers, TRL: about 10 s) are paid once, not once per script.
    scripts = env_scripts()[env]
    job = jobs / "tmp.scripts.py"
    job.write_text("".join(_preamble(script, shim) + CHECK.format(statements=[
        s for s in job_imports(script) if not third_party([s]) & OPTIONAL]) for script in scripts))
    proc = subprocess.run([str(python), str(job)], cwd=workdir, env=clean, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"failed"')]
    assert [out["rule"] for out in outs] == [script.stem for script in scripts]
    for script, out in zip(scripts, outs):
        assert out["failed"] == [], f"{script.name} in {env.name}"
        assert out["snaketrl"] == str(ROOT / "scripts" / PKG / "__init__.py")


def calls_first(script: Path, call: str, may_come_before: set[str] = frozenset()) -> bool:
    """`script` makes the top-level call `call` before it imports any snaketrl module but snaketrl.imports (and
    those of `may_come_before`), and imports one."""
    body = ast.parse(script.read_text()).body
    calls = [i for i, node in enumerate(body) if isinstance(node, ast.Expr) and ast.unparse(node) == call]
    ours = [i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom)
            and node.module not in {"snaketrl.imports", *may_come_before} and (node.module or "").split(".")[0] == PKG]
    return bool(calls and ours) and calls[0] < min(ours)


def test_data_jobs_that_load_tokenizers_leave_torch_out():
    """The data env has no torch. A data job that reaches transformers (the length and prompt jobs) tells it torch
    is absent first thing, as that env does, also where one environment holds both: `from transformers import
    AutoTokenizer` would import torch there (2.5 s of CPU in each of 12 jobs). Its tokenizer then loads and
    renders its chat template all the same."""
    reach = [s for s in env_scripts()[ROOT / "envs" / "data.yaml"] if "transformers" in third_party(job_imports(s))]
    assert sorted(s.stem for s in reach) == ["length_histogram", "tokenize_prompts"]
    for script in reach:
        assert calls_first(script, "data_job()"), f"{script.name} imports snaketrl before data_job()"
    check = ("import gc, sys\nfrom snaketrl.imports import data_job\ndata_job()\n"
             "from transformers import AutoTokenizer\nfrom transformers.utils import is_torch_available\n"
             "from snaketrl.models.chat_template import CHATML\nfrom tokenizers import Tokenizer, models\n"
             "from transformers import PreTrainedTokenizerFast\n"
             "t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({'[UNK]': 0}, '[UNK]')), "
             "unk_token='[UNK]', chat_template=CHATML)\n"
             "text = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
             "print(sys.modules['torch'], is_torch_available(), not gc.isenabled(), repr(text))")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split(maxsplit=3)[:3] == ["None", "False", "True"], proc.stdout
    assert repr("<|im_start|>user\nhi<|im_end|>\n") in proc.stdout, proc.stdout


def test_training_side_jobs_skip_bitsandbytes_without_a_gpu():
    """bitsandbytes serves only QLoRA (CUDA only) and costs every job about 3 s of imports: each script of the train
    env (and each launched process) starts the job first thing, which tells peft and transformers it is absent
    where no CUDA GPU is visible, and pauses the cyclic collector until the job's imports are done."""
    launched = ROOT / "snaketrl" / "train" / "__main__.py"
    for script in [*env_scripts()[ROOT / "envs" / "train.yaml"], launched]:
        before = {"snaketrl.processes"} if script == launched else set()  # die_with_parent
        assert calls_first(script, "start_job()", before), f"{script.name} imports snaketrl before it starts the job"
    check = ("import gc, sys\nfrom snaketrl.imports import imports_done, start_job\nstart_job()\n"
             "import peft, transformers\nfrom peft.import_utils import is_bnb_available\n"
             "from transformers.utils import is_bitsandbytes_available\npaused = not gc.isenabled()\nimports_done()\n"
             "print(sys.modules['bitsandbytes'], is_bnb_available(), is_bitsandbytes_available(), paused, "
             "gc.isenabled(), gc.get_freeze_count() > 100000)")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None", "False", "False", "True", "True", "True"]


def test_training_side_jobs_keep_freed_memory():
    """glibc maps each block over 32 MB afresh and unmaps it at free, so a job's next logits tensor of that size
    starts on untouched pages; after start_job such a block comes from the heap and stays there once freed
    (snaketrl.processes.keep_freed_memory), as glibc's own accounting says (mallinfo2: mapped bytes, heap bytes)."""
    check = ("import ctypes, json, sys, torch\n"
             "if sys.argv[1] == 'job':\n    from snaketrl.imports import start_job\n    start_job()\n"
             "class Info(ctypes.Structure):\n    _fields_ = [(n, ctypes.c_size_t) for n in ('arena ordblks smblks hblks "
             "hblkhd usmblks fsmblks uordblks fordblks keepcost').split()]\n"
             "libc = ctypes.CDLL(None)\nlibc.mallinfo2.restype = Info\n"
             "x = torch.empty(2 ** 26)\nheld = libc.mallinfo2()\ndel x\nfreed = libc.mallinfo2()\n"
             "print(json.dumps({'mapped': held.hblkhd, 'heap_after_free': freed.arena}))")
    info = {}
    for name, mode, keep in (("plain", "plain", None), ("job", "job", None), ("job, switched off", "job", "0")):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "SNAKETRL_FORKSERVER": "0"}
        env.pop("SNAKETRL_KEEP_FREED_MEMORY", None)
        proc = subprocess.run([sys.executable, "-c", check, mode], capture_output=True, text=True, cwd=ROOT,
                              env={**env, **({"SNAKETRL_KEEP_FREED_MEMORY": keep} if keep else {})})
        assert proc.returncode == 0, proc.stderr[-2000:]
        info[name] = json.loads(proc.stdout)
    block = 2 ** 28  # 256 MB
    for name in ("plain", "job, switched off"):
        assert info[name]["mapped"] >= block and info[name]["heap_after_free"] < block, info
    assert info["job"]["mapped"] < block and info["job"]["heap_after_free"] >= block, info
