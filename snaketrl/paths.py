"""The results layout, in one place: one function per artifact; and the paths a config names.

Rules call these with wildcard placeholders (`paths.lengths("{trainer}", "{dataset}", "{model}")`)
to get patterns, scripts and benches with real names to get files. Pure Python: the Snakefile
imports it while parsing.

Results are relative to the working directory (Snakemake's `--directory`, or the directory of a
workflow that uses this one as a module), as are the files a user's config names. Files that ship
with the workflow (sample data, accelerate configs) are not: a config names them `workflow:<path>`,
and the Snakefile's `shipped(path)` finds them in the workflow's own directory.
"""

from __future__ import annotations

from collections.abc import Callable

RESULTS = "results"

# A config path starting with this names a file of the workflow (`workflow:data/samples/tldr.jsonl`),
# wherever the workflow runs from; any other relative path is the user's, read from the working directory.
SHIPPED_PREFIX = "workflow:"


def from_config(value: str, shipped: Callable[[str], str] | None = None) -> str:
    """The file a path written in the config names, as a job reads it: `workflow:<rel>` is `shipped(rel)`
    (without `shipped`, <rel> itself: a run from the clone's root, as tests and benches do); anything else
    is returned as written."""
    if value.startswith(SHIPPED_PREFIX):
        rel = value[len(SHIPPED_PREFIX):]
        return shipped(rel) if shipped else rel
    return value


def raw(dataset: str, split: str) -> str:
    """A dataset as fetched (Hub or local files), split into train/eval."""
    return f"{RESULTS}/datasets/{dataset}/raw/{split}.jsonl"


def raw_origin(dataset: str) -> str:
    """Where each raw row came from (source file and line), for error messages."""
    return f"{RESULTS}/datasets/{dataset}/raw/origin.json"


def prepared(dataset: str, trainer: str, split: str) -> str:
    """A dataset mapped to the columns of the trainer's layout."""
    return f"{RESULTS}/datasets/{dataset}/{trainer}/{split}.jsonl"


def prepared_summary(dataset: str, trainer: str) -> str:
    """Rows in, rows kept and rows dropped by preprocessing."""
    return f"{RESULTS}/datasets/{dataset}/{trainer}/summary.json"


def tokenized(dataset: str, trainer: str, model: str, split: str) -> str:
    """Prompts as token ids of one model's tokenizer (PPO)."""
    return f"{RESULTS}/datasets/{dataset}/{trainer}/{model}/{split}.jsonl"


def model(model: str) -> str:
    """A base model directory: downloaded, or built and pretrained here."""
    return f"{RESULTS}/models/{model}"


def model_init(model: str) -> str:
    """A tiny model before pretraining: its tokenizer and random weights."""
    return f"{RESULTS}/pretrain/{model}/init"


def pretrain_file(model: str, name: str) -> str:
    """A tiny model's pretraining record: trainer_state.json, metrics.json (with a generated sample)."""
    return f"{RESULTS}/pretrain/{model}/{name}"


def lengths(trainer: str, dataset: str, model: str, ext: str = "json") -> str:
    """The length histogram (json: statistics and the chosen max_length; png: the plot)."""
    return f"{RESULTS}/lengths/{trainer}/{dataset}/{model}.{ext}"


def run_dir(run: str) -> str:
    return f"{RESULTS}/runs/{run}"


def run_file(run: str, name: str) -> str:
    """trainer_state.json, metrics.json, manifest.json, curves.png, log_history.csv."""
    return f"{run_dir(run)}/{name}"


def adapter(run: str) -> str:
    return f"{run_dir(run)}/adapter"


def merged(run: str) -> str:
    """A run's adapter merged into its base: another run's policy or reward model."""
    return f"{run_dir(run)}/merged"


def evaluation(name: str, file: str) -> str:
    """One eval job's output (name: a run, or base-<model>): completions.jsonl (one row per prompt, every
    score) and metrics.json (the run's aggregates)."""
    return f"{RESULTS}/evaluation/{name}/{file}"


def evaluation_db() -> str:
    """Every eval job's rows and metrics, and the training-time samples, in one SQLite database."""
    return f"{RESULTS}/evaluation.sqlite"


def training_samples(run: str) -> str:
    """Completions sampled while training (GRPO/RLOO generation batches, PPO sample generations)."""
    return run_file(run, "training_samples.jsonl")


def checkpoints(run: str) -> str:
    """Outside the declared outputs: Snakemake deletes those when a job fails, and a rerun resumes from here."""
    return f"{RESULTS}/checkpoints/{run}"


def trackio() -> str:
    """trackio's store (a SQLite file per project) for runs that report_to trackio: the live view's."""
    return f"{RESULTS}/trackio"


def log(rule: str, *names: str) -> str:
    return f"{RESULTS}/logs/{rule}/{'/'.join(names)}.log"


def benchmark(rule: str, *names: str) -> str:
    return f"{RESULTS}/benchmarks/{rule}/{'/'.join(names)}.tsv"


def report() -> str:
    return f"{RESULTS}/report.html"
