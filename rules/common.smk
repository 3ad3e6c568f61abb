import re

from snaketrl.trainers import REGISTRY


def _alternatives(names):
    return "|".join(re.escape(n) for n in names) or "(?!)"


TINY_MODELS = [m for m, e in config["models"].items() if "tiny" in e]
HUB_MODELS = [m for m, e in config["models"].items() if "hub" in e]
USED_DATASETS = sorted({run["dataset"] for run in RUNS.values()})

wildcard_constraints:
    run=_alternatives(RUNS),
    model=_alternatives(config["models"]),
    dataset=_alternatives(config["datasets"]),
    trainer=_alternatives(REGISTRY),


def run_of(wildcards):
    return RUNS[wildcards.run]


def run_inputs(wildcards):
    """A run's model (the base, or another run's merged model), data, lengths and reward model."""
    run = run_of(wildcards)
    spec = REGISTRY[run["trainer"]]
    parts = ["results/datasets", run["dataset"], run["trainer"]]
    if spec.tokenized:
        parts.append(run["model"])  # token ids depend on the model's tokenizer
    data = "/".join(parts)
    inputs = {
        "model": merged(run["policy"]) if run.get("policy") else f"results/models/{run['model']}",
        "train": f"{data}/train.jsonl",
        "eval": f"{data}/eval.jsonl",
        "lengths": f"results/lengths/{run['trainer']}/{run['dataset']}/{run['model']}.json",
    }
    if run.get("reward_model"):
        inputs["reward_model"] = merged(run["reward_model"])
    return inputs


def merged(run):
    return f"results/runs/{run}/merged"


def model_class(wildcards):
    return REGISTRY[RUNS[wildcards.run]["trainer"]].model_class


def length_batch_size(wildcards):
    """Batch size the padding estimate assumes: that of the first run sharing these lengths."""
    from snaketrl.config import trl_args

    for run in RUNS.values():
        if (run["trainer"], run["dataset"], run["model"]) == (wildcards.trainer, wildcards.dataset, wildcards.model):
            return trl_args(config, run).get("per_device_train_batch_size", 8)
    return 8


def per_attempt(base):
    """A resource (mem_mb, runtime) that grows with each retry: attempt 1, 2, ..."""
    return lambda wildcards, attempt: base * attempt
