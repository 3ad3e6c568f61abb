"""The config, read at parse time (pure Python: no torch, transformers or trl): this face hands on the names the
Snakefile, rules/common.smk and the tests use.

schema: the config against config/schema.yaml, YAML mistakes. matrix: the runs a config asks for, and seeds.
checks: the cross-checks, and `resolve_runs`, the one entry point. resolve: a run resolved, as its jobs take it.
files: the local files a config names. args: TRL and LoRA fields where they are written. fields: TRL's config
classes read without importing trl. sweeps: hyperparameter grids. evaluation: the `evaluation:` section.
"""

from snaketrl.config.checks import BATCH_DEFAULTS, GENERATION_DEFAULTS, check_reward_func, resolve_runs
from snaketrl.config.files import chat_template_file, corpus_files, gguf_file, local_files
from snaketrl.config.matrix import expand_runs
from snaketrl.config.resolve import (batching_of, canonical, chat_model, chat_prompts, length_settings,
                                     live_environment, lora_args, model_source_entry, trl_args)
from snaketrl.config.schema import validate, yaml_mistake
from snaketrl.errors import ConfigError

__all__ = ["BATCH_DEFAULTS", "GENERATION_DEFAULTS", "ConfigError", "batching_of", "canonical", "chat_model",
           "chat_prompts", "chat_template_file", "check_reward_func", "corpus_files", "expand_runs", "gguf_file", "length_settings",
           "live_environment", "local_files", "lora_args", "model_source_entry", "resolve_runs", "trl_args",
           "validate", "yaml_mistake"]
