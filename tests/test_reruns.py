"""A result always follows its config: after a complete run, each config edit schedules exactly the
jobs whose output it decides, and a cosmetic edit schedules nothing.

Scheduled jobs come from Snakemake's machine-readable plan (`--summary`: one row per output file with
its rule and `update pending`/`no update`); the expected jobs from an independent model of the DAG
below (which job reads what), closed downstream from the jobs an edit touches directly.
"""

import copy
import csv
import io

import pytest
import snakemake_cli
import yaml
from test_workflow import env

from snaketrl import paths
from snaketrl.config import resolve_runs, validate
from snaketrl.config.evaluation import check_evaluation, eval_job_inputs, eval_targets
from snaketrl.trainers import REGISTRY

SCHEMA = "config/schema.yaml"


def load_config(workdir):
    return yaml.safe_load((workdir / "config" / "config.yaml").read_text())


def resolved(cfg):
    cfg = copy.deepcopy(cfg)
    validate(cfg, SCHEMA)
    return cfg, resolve_runs(cfg)


def evaluation(cfg, runs):
    ev = check_evaluation(cfg.get("evaluation"), runs, cfg["datasets"])
    return ev, (eval_targets(ev, runs) if ev else {})


def primary_outputs(runs, cfg):
    """Output files -> the job that writes them, as (rule, *wildcards)."""
    out = {paths.report(): ("report",), paths.evaluation_db(): ("collect_evaluation",)}
    ev, targets = evaluation(cfg, runs)
    for kind in ("prompts", "references", "pairs"):
        if ev and ev[kind]:
            d, t = ev[kind]["dataset"], ev[kind]["trainer"]
            out[paths.prepared(d, t, ev[kind]["split"])] = ("preprocess", d, t)
    for name in targets:
        out[paths.evaluation(name, "metrics.json")] = ("evaluate", name)
        out[paths.evaluation(name, "completions.jsonl")] = ("evaluate", name)
        out[paths.evaluation(name, "pairs.jsonl")] = ("evaluate", name)
    for m, d in corpus_datasets(runs, cfg):
        out[paths.raw(d, "train")] = ("get_dataset", d)
    for name, run in runs.items():
        t, d, m = run["trainer"], run["dataset"], run["model"]
        out[paths.raw(d, "train")] = ("get_dataset", d)
        out[paths.prepared(d, t, "train")] = ("preprocess", d, t)
        out[paths.prepared(d, t, "eval")] = ("preprocess", d, t)
        out[paths.adapter(name)] = ("train", name)
        out[paths.model_init(m)] = ("tiny_model", m)
        out[paths.model(m)] = ("pretrain", m)
        out[paths.lengths(t, d, m)] = ("length_histogram", t, d, m)
        if REGISTRY[t].tokenized:
            out[paths.tokenized(d, t, m, "train")] = ("tokenize_prompts", d, t, m)
        out[paths.run_file(name, "trainer_state.json")] = ("train", name)
        out[paths.run_file(name, "curves.png")] = ("plot_run", name)
        out[paths.merged(name)] = ("merge", name)  # only jobs in the DAG show up in the plan
    return out


def corpus_datasets(runs, cfg):
    """(model, dataset) where a tiny model's corpus names a dataset: its train split as fetched."""
    return {(m, d) for m in {r["model"] for r in runs.values()}
            for d in cfg["models"][m].get("tiny", {}).get("corpus", []) if d in cfg["datasets"]}


def dag_edges(runs, cfg):
    """job -> jobs that read its output."""
    edges = {}

    def edge(a, b):
        edges.setdefault(a, set()).add(b)

    for m, d in corpus_datasets(runs, cfg):
        edge(("get_dataset", d), ("tiny_model", m))
        edge(("get_dataset", d), ("pretrain", m))

    ev, targets = evaluation(cfg, runs)
    writer = primary_outputs(runs, cfg)
    for kind in ("prompts", "references", "pairs"):
        if ev and ev[kind]:
            edge(("get_dataset", ev[kind]["dataset"]), ("preprocess", ev[kind]["dataset"], ev[kind]["trainer"]))
    for name, run in runs.items():
        edge(("train", name), ("collect_evaluation",))  # its training-time samples
    for name in targets:
        inputs = eval_job_inputs(name, ev, runs)
        for path in [p for v in inputs.values() for p in (v if isinstance(v, list) else [v])]:
            edge(writer[path] if path in writer else ("merge", path.split("/")[-2]), ("evaluate", name))
        edge(("evaluate", name), ("report",))
        edge(("evaluate", name), ("collect_evaluation",))
    if targets:
        edge(("collect_evaluation",), ("report",))

    for name, run in runs.items():
        t, d, m = run["trainer"], run["dataset"], run["model"]
        train = ("train", name)
        edge(("get_dataset", d), ("preprocess", d, t))
        edge(("preprocess", d, t), ("length_histogram", t, d, m))
        edge(("tiny_model", m), ("pretrain", m))
        edge(("pretrain", m), ("report",))
        edge(("pretrain", m), ("length_histogram", t, d, m))
        if REGISTRY[t].tokenized:
            tok = ("tokenize_prompts", d, t, m)
            for up in (("preprocess", d, t), ("pretrain", m), ("length_histogram", t, d, m)):
                edge(up, tok)
            edge(tok, train)
        else:
            edge(("preprocess", d, t), train)
        edge(("length_histogram", t, d, m), train)
        edge(("preprocess", d, t), ("report",))  # its summary of dropped rows
        for up in (("length_histogram", t, d, m), train, ("plot_run", name)):
            edge(up, ("report",))
        edge(train, ("plot_run", name))
        base = ("merge", run["policy"]) if run["policy"] else ("pretrain", m)
        edge(base, train)
        for ref in (run["policy"], run["reward_model"]):
            if ref:
                edge(("train", ref), ("merge", ref))
                edge(("merge", ref), train)
                if ref == run["policy"]:
                    edge(("pretrain", runs[ref]["model"]), ("merge", ref))
    return edges


def downstream(roots, edges):
    seen, todo = set(), list(roots)
    while todo:
        job = todo.pop()
        if job not in seen:
            seen.add(job)
            todo.extend(edges.get(job, ()))
    return seen


def scheduled(workdir, cfg, tmp_path):
    """Jobs Snakemake would run for `all` with this config, from its --summary plan."""
    config_file = tmp_path / "edited.yaml"
    config_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = snakemake_cli.run(["--summary", "--nolock", "--configfile", str(config_file)], workdir, env(), 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO(proc.stdout[proc.stdout.index("output_file"):]), delimiter="\t"))
    assert rows, proc.stdout[-2000:]
    jobs = primary_outputs(resolved(cfg)[1], cfg)
    return {jobs[row["output_file"]] for row in rows if row["plan"] == "update pending" and row["output_file"] in jobs}


def runs_where(runs, **match):
    return [name for name, run in runs.items() if all(run[k] == v for k, v in match.items())]


def _set(cfg, dotted, value):
    *parents, last = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


# (edit, jobs it touches directly, given the resolved runs and the config)
EDITS = {
    "shared training arg": (lambda c: _set(c, "training.learning_rate", 4e-3),
                            lambda runs, c: {("train", r) for r in runs}),
    "one trainer's args": (lambda c: _set(c, "trainers.dpo.args.beta", 0.2),
                           lambda runs, c: {("train", r) for r in runs_where(runs, trainer="dpo")}),
    "one run's args": (lambda c: _set(c, "runs.sft-qwen2-tiny", {"args": {"learning_rate": 1.0e-2}}),
                       lambda runs, c: {("train", "sft-qwen2-tiny")}),
    "LoRA defaults": (lambda c: _set(c, "lora.r", 8),
                      lambda runs, c: {("train", r) for r in runs}),
    "one model's spec": (lambda c: _set(c, "models.pythia-tiny.tiny.config.intermediate_size", 192),
                         lambda runs, c: {("tiny_model", "pythia-tiny")}),
    "one dataset's column mapping": (lambda c: _set(c, "datasets.tldr.columns", {"prompt": "prompt"}),
                                     lambda runs, c: {("preprocess", "tldr", runs[r]["trainer"])
                                                      for r in runs_where(runs, dataset="tldr")}),
    "one model's pretraining": (lambda c: _set(c, "models.qwen2-tiny.tiny.pretrain.steps", 40),
                                lambda runs, c: {("pretrain", "qwen2-tiny")}),
    "evaluation settings": (lambda c: _set(c, "evaluation.generation.max_new_tokens", 16),
                            lambda runs, c: {("evaluate", n) for n in evaluation(c, runs)[1]}),
    "length.keep_share": (lambda c: _set(c, "length.keep_share", 0.95),
                          lambda runs, c: {("length_histogram", r["trainer"], r["dataset"], r["model"])
                                           for r in runs.values()}),
    "seed": (lambda c: _set(c, "seed", 7),
             lambda runs, c: {("get_dataset", r["dataset"]) for r in runs.values()}
             | {("get_dataset", d) for _, d in corpus_datasets(runs, c)}
             | {("tiny_model", r["model"]) for r in runs.values()}),
}


@pytest.mark.slow
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_schedules_exactly_the_jobs_that_depend_on_it(edit, workflow_run, tmp_path):
    change, touched = EDITS[edit]
    cfg = load_config(workflow_run)
    change(cfg)
    _, runs = resolved(cfg)
    roots = touched(runs, cfg)
    assert roots, edit
    expected = downstream(roots, dag_edges(runs, cfg))
    expected = {job for job in expected if job[0] != "merge" or job[1] in
                {r["policy"] for r in runs.values()} | {r["reward_model"] for r in runs.values()}}
    got = scheduled(workflow_run, cfg, tmp_path)
    assert got == expected, (edit, sorted(got - expected), sorted(expected - got))


def _reordered(value):
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    return value


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["keys reordered", "unused dataset added", "unused model added"])
def test_a_cosmetic_edit_schedules_nothing(edit, workflow_run, tmp_path):
    cfg = load_config(workflow_run)
    assert scheduled(workflow_run, cfg, tmp_path) == set()  # the run is complete
    if edit == "keys reordered":
        cfg = _reordered(cfg)
    elif edit == "unused dataset added":
        cfg["datasets"]["extra"] = {"files": "data/samples/arithmetic.jsonl", "columns": {"prompt": "question"}}
    else:
        cfg["models"]["extra-tiny"] = copy.deepcopy(cfg["models"]["qwen2-tiny"])
    assert scheduled(workflow_run, cfg, tmp_path) == set()


@pytest.mark.slow
def test_a_new_run_schedules_only_its_own_jobs_and_the_report(workflow_run, tmp_path):
    cfg = load_config(workflow_run)
    cfg["runs"]["sft-arith-qwen2-tiny"] = {"trainer": "sft", "model": "qwen2-tiny", "dataset": "arithmetic"}
    cfg["datasets"]["arithmetic"]["columns"] = {"prompt": "question", "completion": "answer"}
    got = scheduled(workflow_run, cfg, tmp_path)
    assert got == {("get_dataset", "arithmetic"), ("preprocess", "arithmetic", "sft"),
                   ("length_histogram", "sft", "arithmetic", "qwen2-tiny"), ("train", "sft-arith-qwen2-tiny"),
                   ("plot_run", "sft-arith-qwen2-tiny"), ("evaluate", "sft-arith-qwen2-tiny"),
                   ("collect_evaluation",), ("report",)}
