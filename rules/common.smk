import re

from snakemake.exceptions import WorkflowError

from snaketrl import paths
from snaketrl.config import (
    canonical,
    chat_prompts,
    chat_template_file,
    corpus_files,
    gguf_file,
    local_files,
    model_source_entry,
)
from snaketrl.config import resolve
from snaketrl.config.evaluation import eval_job_inputs
from snaketrl.evaluate.harness import project_task_files
from snaketrl import remote_code
from snaketrl.train import distributed
from snaketrl.trainers import REGISTRY


def _alternatives(names):
    return "|".join(re.escape(n) for n in names) or "(?!)"


TINY_MODELS = [m for m, e in config["models"].items() if "tiny" in e]
# Models the download_model job brings: a Hub snapshot, or a GGUF file converted.
FETCHED_MODELS = [m for m in config["models"] if m not in TINY_MODELS]


# Run and model names are single path segments (snaketrl.config.checks.NAME), and the layout (snaketrl.paths)
# tells each segment apart: one segment pattern, not a thousand-name alternation that Snakemake would rewrite
# into the output patterns of every job (seconds per dry run).
wildcard_constraints:
    run="[^/]+",
    model="[^/]+",
    dataset=_alternatives(config["datasets"]),
    trainer=_alternatives(REGISTRY),


def run_of(wildcards):
    return RUNS[wildcards.run]


def train_threads(wildcards):
    """The model's threads (model_threads), at least one per CPU process of the run (`processes`): the job shares
    them out among its processes (scripts/train.py), so N processes never run N times the threads.
    """
    run = run_of(wildcards)
    return max(model_threads(run["model"]), run.get("processes", 1))


def base_of(run):
    """A run's starting model: its base model, or another run's merged model (`policy`)."""
    return paths.merged(run["policy"]) if run["policy"] else paths.model(run["model"])


def run_inputs(wildcards):
    """A run's model, data, lengths, reward model, and the accelerate config a multi-GPU job launches with."""
    run = run_of(wildcards)
    t, d, m = run["trainer"], run["dataset"], run["model"]
    if REGISTRY[t].tokenized:  # token ids depend on the model's tokenizer
        data = {s: paths.tokenized(d, t, m, s) for s in ("train", "eval")}
    else:
        data = {s: paths.prepared(d, t, s) for s in ("train", "eval")}
    inputs = {
        "model": base_of(run),
        **data,
        "lengths": paths.lengths(t, d, m),
        "accelerate": distributed.config_file(run["distributed"], shipped),
    }
    if run["reward_model"]:
        inputs["reward_model"] = paths.merged(run["reward_model"])
    return inputs


def dataset_source(wildcards):
    """split -> the local file of a dataset entry (a `workflow:` one: the workflow's copy). The job reads
    these, so an edit of one refetches the dataset; params keep the names as written, which stay the same
    from any working directory."""
    return local_files(config["datasets"][wildcards.dataset], shipped)


def tiny_corpus(wildcards):
    return corpus_files(config, wildcards.model, shipped)


def dataset_fetch(wildcards):
    """What decides the fetched rows (not the column mapping or format: preprocessing applies those; nor
    chat: the jobs that know the model apply it)."""
    entry = config["datasets"][wildcards.dataset]
    keep = {k: v for k, v in entry.items() if k not in ("columns", "format", "chat")}
    return canonical({**keep, "seed": config["seed"]})


def dataset_mapping(wildcards):
    entry = config["datasets"][wildcards.dataset]
    return canonical(
        {
            "layout": REGISTRY[wildcards.trainer].layout,
            "columns": entry["columns"],
            "format": entry["format"],
            "bad_rows": entry.get("bad_rows", "error"),
        }
    )


def model_source(wildcards):
    """The local GGUF file (or parts) a model is converted from, and the local chat template file or tokenizer it
    is given, if any: an edit of one makes the model again."""
    entry = config["models"][wildcards.model]
    return {**gguf_file(entry, shipped), **chat_template_file(entry, shipped)}


def chat_of(wildcards):
    """Whether the dataset's plain prompts reach the model as chat turns (absent where not: the params of
    configs without chat models stay as they were)."""
    chat = chat_prompts(
        config["models"][wildcards.model], config["datasets"][wildcards.dataset]
    )
    return {"chat": True} if chat else {}


def model_threads(model):
    """CPU threads of a model's train, evaluate and merge jobs: models.<m>.threads, else 1 for a tiny model (its
    numbers are measured on one thread: threads change the float sums) and all of --cores for others. Snakemake
    lowers it to --cores; a profile's set-threads overrides it."""
    entry = config["models"][model]
    if entry.get("threads"):
        return entry["threads"]
    if "tiny" in entry:
        return 1
    # A cluster run without --cores: the profile's set-threads decides.
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def tiny_entry(wildcards):
    """What decides the tokenizer and the random init (not the pretraining settings)."""
    tiny = config["models"][wildcards.model]["tiny"]
    return canonical(
        {**{k: v for k, v in tiny.items() if k != "pretrain"}, "seed": config["seed"]}
    )


def pretrain_settings(wildcards):
    return canonical(
        {
            **config["models"][wildcards.model]["tiny"]["pretrain"],
            "seed": config["seed"],
        }
    )


def pretrained_models():
    """The tiny models the runs use: the report shows their pretraining."""
    return sorted({run["model"] for run in RUNS.values()} & set(TINY_MODELS))


def _first_run_batches():
    """(trainer, dataset, model) -> the batch size of the first run (by name) with those lengths:
    once at parse time, not a scan of every run per histogram job."""
    batches = {}
    for _, run in sorted(RUNS.items()):
        key = (run["trainer"], run["dataset"], run["model"])
        batches.setdefault(key, run["args"].get("per_device_train_batch_size", 8))
    return batches


LENGTH_BATCHES = _first_run_batches()


def length_settings(wildcards):
    """How the histogram chooses max_length and the batching, and the batch size its efficiency estimates
    assume: that of the first run (by name) sharing these lengths."""
    t, d, m = wildcards.trainer, wildcards.dataset, wildcards.model
    return resolve.length_settings(config, t, d, m, LENGTH_BATCHES.get((t, d, m), 8))


def train_priority(wildcards):
    """Runs in a chain (SFT -> GRPO, the reward model -> PPO: the longest path, and the longest jobs) train
    before a run on its own, which fills the cores beside them; evaluation comes after.
    """
    run = run_of(wildcards)
    feeds = any(
        wildcards.run in (r["policy"], r["reward_model"]) for r in RUNS.values()
    )
    return 2 if feeds or run["policy"] or run["reward_model"] else 1


def run_threads(wildcards):
    return model_threads(run_of(wildcards)["model"])


def merge_settings(wildcards):
    run = run_of(wildcards)
    return {
        "task_type": REGISTRY[run["trainer"]].task_type,
        **remote_code.param(run["model_entry"]),
    }


def plot_settings(wildcards):
    spec = REGISTRY[run_of(wildcards)["trainer"]]
    return {"title": wildcards.run, "first": [spec.overlay, *spec.headline]}


def report_runs():
    """Every run, by name: the report's inputs are lists in this order."""
    return sorted(RUNS)


def eval_groups():
    """Eval job -> its group: the run without its seed (a base is its own), the leaderboard's row."""
    return {n: RUNS[n]["group"] if n in RUNS else n for n in EVAL_TARGETS}


def per_attempt(base):
    """A resource (mem_mb, runtime) that grows with each retry: attempt 1, 2, ..."""
    return lambda wildcards, attempt: base * attempt


# The workflow's copies of the files its lm-eval tasks read (data/samples/arithmetic.jsonl), once.
LM_EVAL_DATA = (
    [shipped(f) for f in project_task_files(EVAL["lm_eval"]["tasks"])] if EVAL else []
)


def eval_settings():
    """What decides an eval job's output: the evaluation section without its list of runs, so that adding
    a run does not rerun every other run's evaluation."""
    return canonical({k: v for k, v in EVAL.items() if k != "runs"}) if EVAL else None
