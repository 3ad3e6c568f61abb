"""The configuration reference (docs/configuration-reference.md), generated from config/schema.yaml.

One row per key the schema allows: its path, type, default, one-line meaning (the key's `description`) and an
example (its first `examples` entry). The schema is the one definition; the page is rewritten from it, so it
cannot drift. `python -m snaketrl.config.reference` rewrites the page; `--check` says whether it is current.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "config" / "schema.yaml"
PAGE = ROOT / "docs" / "configuration-reference.md"

# What a user-chosen key is called in a key path (models.<model>.hub); maps not listed get <name>.
PLACEHOLDERS = {"models": "<model>", "datasets": "<dataset>", "trainers": "<trainer>", "runs": "<run>",
                "sweeps": "<trainer>", "columns": "<column>", "batching": "<trainer>"}

HEADER = """# Configuration reference

Generated from [`config/schema.yaml`](../config/schema.yaml) by `python -m snaketrl.config.reference`; do not
edit by hand (`tests/test_reference.py` fails when this page and the schema disagree). What the keys do
together, with examples: [configuration.md](configuration.md). `<model>`, `<dataset>`, `<run>`, ... stand for
names you choose. A default of `-` means none: the key is optional, or required where marked.

| key | type | default | meaning | example |
|---|---|---|---|---|
"""


def load(path: Path = SCHEMA) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def resolved(node: dict, defs: dict) -> dict:
    """`node` with its $ref replaced by the definition; the referring node's own keywords win."""
    if "$ref" not in node:
        return node
    target = defs[node["$ref"].rsplit("/", 1)[-1]]
    return {**resolved(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}


def type_of(node: dict, defs: dict) -> str:
    node = resolved(node, defs)
    if "enum" in node:
        return "one of " + ", ".join(inline(v) for v in node["enum"])
    if any(set(branch) - {"required"} for branch in node.get("oneOf", [])):  # not only "one of these keys"
        names = []
        for branch in node["oneOf"]:
            for name in type_of(branch, defs).split(" or "):
                if name not in names:
                    names.append(name)
        return " or ".join(names)
    kinds = node.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "array" in kinds and "items" in node:
        item = resolved(node["items"], defs)
        if "oneOf" not in item and "type" in item and not isinstance(item["type"], list):
            kinds = [f"array of {item['type']}" if k == "array" else k for k in kinds]
    if "object" in kinds and isinstance(node.get("additionalProperties"), dict) and "properties" not in node:
        value = type_of(node["additionalProperties"], defs)
        kinds = [f"mapping to {value}" if k == "object" else k for k in kinds]
    return " or ".join(kinds)


def inline(value) -> str:
    """A value as it is written in YAML, on one line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip().removesuffix(
        "\n...").strip()


def rows(schema: dict) -> list[dict]:
    """Every key under `properties`, depth first in schema order, with user-named maps (models.<model>) and
    the object branches of a oneOf (datasets.<dataset>.files.train) descended into."""
    defs = schema.get("$defs", {})
    out = []

    def walk(node: dict, path: str, required: set) -> None:
        node = resolved(node, defs)
        for key, child in node.get("properties", {}).items():
            child_path = f"{path}.{key}" if path else key
            child = resolved(child, defs)
            out.append({"key": child_path, "type": type_of(child, defs), "default": child.get("default", "-"),
                        "has_default": "default" in child, "required": key in required,
                        "description": child.get("description"), "examples": child.get("examples", [])})
            descend(child, child_path, key)
        descend_branches(node, path)

    def descend(node: dict, path: str, key: str) -> None:
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            extra = resolved(extra, defs)
            if "properties" in extra or "oneOf" in extra:
                walk(extra, f"{path}.{PLACEHOLDERS.get(key, '<name>')}", set(extra.get("required", [])))
        if "properties" in node or "oneOf" in node:
            walk(node, path, set(node.get("required", [])))

    def descend_branches(node: dict, path: str) -> None:
        for branch in node.get("oneOf", []):
            branch = resolved(branch, defs)
            if "properties" in branch:
                walk(branch, path, set(branch.get("required", [])))

    walk(schema, "", set(schema.get("required", [])))
    seen, unique = set(), []
    for row in out:  # a key reached through two branches is listed once
        if row["key"] not in seen:
            seen.add(row["key"])
            unique.append(row)
    return unique


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def prose(text: str) -> str:
    """A description in a cell: `<N>` escaped, or Markdown would take it for an HTML tag and hide it."""
    return cell(text).replace("<", "\\<")


def code(value) -> str:
    text = inline(value)
    return f"`{text}`" if "`" not in text else text


def page(schema: dict) -> str:
    lines = []
    for row in rows(schema):
        default = "required" if row["required"] else (code(row["default"]) if row["has_default"] else "-")
        example = code(row["examples"][0]) if row["examples"] else ""
        lines.append(f"| `{row['key']}` | {cell(row['type'])} | {cell(default)} | "
                     f"{prose(row['description'] or '')} | {cell(example)} |")
    return HEADER + "\n".join(lines) + "\n"


def missing_descriptions(schema: dict) -> list[str]:
    return [row["key"] for row in rows(schema) if not (row["description"] or "").strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date; write nothing")
    args = parser.parse_args(argv)
    schema = load()
    missing = missing_descriptions(schema)
    if missing:
        print(f"{SCHEMA}: keys without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = page(schema)
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is out of date with {SCHEMA}: run python -m snaketrl.config.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(text.splitlines()) - HEADER.count(chr(10))} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
