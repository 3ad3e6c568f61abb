"""A run resolved: everything that decides its training (the train job's params, the manifest's config and
the resume fingerprint), each value canonical so that the same config in another key order reruns nothing.
"""

from __future__ import annotations

from snaketrl import remote_code
from snaketrl.models import chat_template
from snaketrl.train import distributed, live
from snaketrl.trainers import REGISTRY


def model_entry(entry: dict) -> dict:
    """A model's entry without its `threads`: those are the job's (Snakemake's threads, lowered to --cores), so a
    machine with other cores reruns nothing; the manifest records them (numerics.threads)."""
    return {key: value for key, value in entry.items() if key != "threads"}


def model_source_entry(entry: dict) -> dict:
    """What decides a downloaded model's files: its source (hub, revision, trust_remote_code; or gguf) and the chat
    template it is given (a named one with the revision of how it renders), not how runs train it (lora,
    quantization, chat, threads)."""
    source = {key: entry[key] for key in ("hub", "revision", "trust_remote_code", "gguf", "chat_template")
              if key in entry}
    if chat_template.kind(entry.get("chat_template", "")) == "named":
        source["chat_template_revision"] = chat_template.REVISION
    return source


def chat_model(entry: dict) -> bool:
    """A chat model: its tokenizer ships a chat template that its prompts are meant to be in. Decided from the
    config (models.<name>.chat; default: a hub or gguf model is one, a tiny model is not), so that each job's
    params carry it; the jobs check that such a model has a template."""
    chat = entry.get("chat")
    return "tiny" not in entry if chat is None else chat


def chat_prompts(model_entry: dict, dataset_entry: dict) -> bool:
    """Whether a dataset's plain-text prompts reach a model as chat turns (snaketrl.data.chat.as_chat):
    datasets.<name>.chat, `auto` (the default) meaning for chat models."""
    wanted = dataset_entry.get("chat", "auto")
    return chat_model(model_entry) if wanted == "auto" else wanted


def canonical(value):
    """Dicts with their keys sorted, recursively. Snakemake compares a job's params by repr, so without
    this the same config with its keys in another order would rerun jobs."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def resolve_run(config: dict, name: str, run: dict, reward_model_entry: dict | None = None) -> dict:
    """Everything that decides a run's training, resolved: the train job's params, the manifest's config and
    (with its input hashes) the resume fingerprint. `reward_model_entry`: the model entry of its reward run's
    model (whose code the run then loads only where that entry trusts it)."""
    lora = lora_args(config, run["model"])
    if REGISTRY[run["trainer"]].task_type == "SEQ_CLS":
        # Known TRL pitfall: without this the freshly initialised `score` head is neither trained nor saved.
        lora["modules_to_save"] = sorted({*lora.get("modules_to_save", []), "score"})
    return canonical({
        "name": name, "trainer": run["trainer"], "model": run["model"], "dataset": run["dataset"],
        # The live view's fields go to the jobs in the environment (snaketrl.train.live): not a result's.
        "args": live.without_view(trl_args(config, run)), "lora": lora,
        "model_entry": model_entry(config["models"][run["model"]]),
        "dataset_entry": config["datasets"][run["dataset"]],
        "reward_funcs": run.get("reward_funcs", []), "reward_model": run.get("reward_model"),
        "policy": run.get("policy"), "seed": run.get("seed", config["seed"]), "group": run.get("group", name),
        "distributed": run.get("distributed", distributed.DEFAULT),
        # Only where it is more than 1: a one-process run's params (and resume fingerprint) stay as they were.
        **({"processes": run["processes"]} if run.get("processes", 1) > 1 else {}),
        **({"sweep": run["sweep"], "swept": run["swept"]} if run.get("sweep") else {}),
        # Absent where false or unset, so the runs of configs without them keep their params (and results).
        **({"chat": True} if chat_prompts(config["models"][run["model"]], config["datasets"][run["dataset"]]) else {}),
        **({"eval_rows": run["eval_rows"]} if run.get("eval_rows") else {}),
        **({"max_tokens": run["max_tokens"]} if run.get("max_tokens") else {}),
        **({"max_flops": run["max_flops"]} if run.get("max_flops") else {}),
        **({"reward_trust_remote_code": True} if remote_code.trusted(reward_model_entry) else {}),
    })


def trl_args(config: dict, run: dict) -> dict:
    """TRL config fields: shared training defaults < per-trainer args < per-run args."""
    return {**config.get("training", {}), **config["trainers"][run["trainer"]].get("args", {}), **run.get("args", {})}


def lora_args(config: dict, model: str) -> dict:
    return {**config.get("lora", {}), **config["models"][model].get("lora", {})}


def batching_of(config: dict, trainer: str) -> str:
    """The batching length.batching asks of `trainer`: one for all, or per trainer (auto where unnamed)."""
    batching = config.get("length", {}).get("batching", "auto")
    return batching if isinstance(batching, str) else batching.get(trainer, "auto")


def length_settings(config: dict, trainer: str, dataset: str, model: str, batch_size: int,
                    batching: str | None = None) -> dict:
    """How the length stage chooses max_length and the batching for (trainer, dataset, model): the `length`
    section, the batch size its efficiency estimates assume, and `batching` asked (default: the config's)."""
    return canonical({
        **{k: v for k, v in config["length"].items() if k != "batching"},
        "trainer": trainer,
        "layout": REGISTRY[trainer].layout,
        "batch_size": batch_size,
        "seed": config["seed"],
        "batching": batching or batching_of(config, trainer),
        "attn_implementation": config["models"][model].get("attn_implementation"),
        **({"chat": True} if chat_prompts(config["models"][model], config["datasets"][dataset]) else {}),
        **remote_code.param(config["models"][model]),
    })


def live_environment(config: dict, runs: dict[str, dict]) -> dict[str, str]:
    """The environment that hands each resolved run's live-view fields (`report_to`, `project`) to its train job
    (snaketrl.train.live.environment): the fields as the run's `training`, trainer and `runs` entry write them."""
    def written(run):
        entry = (config.get("runs") or {}).get(run.get("sweep") or run["group"], {})
        return {**(config.get("training") or {}), **config["trainers"][run["trainer"]].get("args", {}),
                **entry.get("args", {})}

    return live.environment({name: written(run) for name, run in runs.items()})
