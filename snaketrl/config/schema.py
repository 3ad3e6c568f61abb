"""The config against its JSON schema (config/schema.yaml), and YAML mistakes: each as one line naming the key
path, or the file, line and column, with the key meant.
"""

from __future__ import annotations

from snaketrl.errors import ConfigError, did_you_mean


def validate(config: dict, schema_path: str) -> None:
    """Validate against the JSON schema, filling its defaults (snakemake.utils.validate); a failure
    becomes one line naming the key path and what was expected."""
    from snakemake.utils import validate as snakemake_validate

    try:
        snakemake_validate(config, schema_path)
    except Exception:
        import jsonschema
        import yaml

        with open(schema_path) as f:
            schema = yaml.safe_load(f)
        best = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
        if best is None:
            raise
        path = ".".join(str(p) for p in best.absolute_path) or "(top level)"
        if best.validator == "additionalProperties" and isinstance(best.instance, dict):
            raise ConfigError(unknown_key(best.absolute_path, best.instance, best.schema)) from None
        if best.validator == "oneOf" and all("required" in alt for alt in best.validator_value):
            names = [f"'{alt['required'][0]}'" for alt in best.validator_value]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
            message = f"needs exactly one of {expected}"
        else:
            message = best.message
        raise ConfigError(f"config: {path}: {message}") from None


# Keys of a model's loading in other tools (transformers, bitsandbytes) and what does it here.
BNB = "use quantization: 4bit (the workflow sets bitsandbytes' nf4 with double quantization)"
MODEL_LOADING = {"load_in_4bit": BNB, "bnb_4bit_": BNB, "load_in_8bit": "use quantization: 8bit",
                 "quantization_config": "use quantization: 4bit or 8bit",
                 "torch_dtype": "the workflow loads weights in the hardware's dtype (bf16 on a bf16 GPU, else fp32)",
                 "dtype": "the workflow loads weights in the hardware's dtype (bf16 on a bf16 GPU, else fp32)"}


def unknown_key(at, instance: dict, schema: dict) -> str:
    """The message for a key the schema does not allow: the key path, and the key meant (a did-you-mean among
    the object's own keys, or what does here what another tool's key does)."""
    allowed = list(schema.get("properties", {}))
    key = next(str(k) for k in instance if k not in allowed)
    path = ".".join([*(str(p) for p in at), key])
    hint = next((v for k, v in MODEL_LOADING.items() if key == k or (k.endswith("_") and key.startswith(k))), None)
    if hint and "quantization" in allowed:  # a model entry
        return f"config: {path}: unknown key; {hint}"
    return f"config: {path}: unknown key{did_you_mean(key, allowed) or f'; expected one of {sorted(allowed)}'}"


def yaml_mistake(path: str) -> str | None:
    """A YAML mistake in a config file as one line naming the file, line and column (Snakemake's own message
    names neither), or None when the file reads. libyaml reads a good file in a millisecond; a bad one is
    read again by PyYAML's own parser, whose messages say more."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return None
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        pass
    try:
        with open(path, encoding="utf-8") as f:
            yaml.safe_load(f)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        start = err.context_mark
        context = (f" ({err.context} that started at line {start.line + 1})" if err.context and start and mark
                   and start.line != mark.line else "")
        hint = "; YAML indents with spaces, never tabs" if "\\t" in str(err.problem) else ""
        return f"config: {path}{where}: {err.problem}{context}{hint}"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return f"config: {path}: {err}"
    return None
