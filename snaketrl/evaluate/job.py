"""The eval job: one run (or base model) on the configured prompts, references, pairs, reward functions,
reward models and lm-eval tasks, into completions.jsonl and metrics.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from snaketrl.evaluate.kinds import JUDGE_PROMPTS, judge_chat, judge_prompt_sets
from snaketrl.data.chat import as_chat, require_template
from snaketrl.divergence import HINT, Diverged, advice, finite
from snaketrl.errors import ConfigError, DataError
from snaketrl.evaluate.generation import generate
from snaketrl.evaluate.harness import lm_eval_run, lm_eval_task_manager, project_task_files
from snaketrl.evaluate.kinds import check_rows, score_name
from snaketrl.evaluate.likelihood import KL_ESTIMATOR, completion_nll, kl_to_reference, preference_accuracy
from snaketrl.evaluate.loading import load_for_eval
from snaketrl.evaluate.scoring import distinct_n, mean_std, reward_function_scores, reward_model_scores, win_rate
from snaketrl.imports import imports_done
from snaketrl.io import read_json, read_jsonl, write_json, write_jsonl
from snaketrl.models.merge import MERGED_FROM
from snaketrl.remote_code import TRUSTED_JUDGES, trusted

log = logging.getLogger("snaketrl.evaluate")


def _rows(path, kind: str, size, where: str, key: str, dataset: str) -> list[dict]:
    """The first `size` rows of an eval split (all without a size). A size beyond the split is refused: a
    comparison on fewer rows than configured would pass for the configured one."""
    rows = read_jsonl(path)
    check_rows(rows, kind, f"{where}: {path}")
    if size and len(rows) < size:
        raise DataError(f"{where}: {key} is {size}, but the eval split of dataset '{dataset}' ({path}) holds "
                        f"{len(rows)} rows; set {key} to at most {len(rows)}, or hold out more rows (datasets.{dataset}.eval_size, "
                        f"or a longer eval file)")
    return rows[:size] if size else rows


def _prompt_key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)


# The column naming the set a completion's prompt is from: a reward model's own prompts (their dataset); absent on
# the yardstick's (evaluation.prompts).
PROMPT_SET = "prompt_set"


def _pair_key(row: dict) -> str:
    """A pair's identity across eval jobs: its prompt, chosen and rejected, hashed."""
    text = json.dumps([row["prompt"], row["chosen"], row["rejected"]], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _scorer(model_dir, adapter_dir=None) -> dict:
    """The weights a job scores pairs with, as the pairs file records them: a model directory and the adapter on
    it. A merged directory without an adapter is the base and adapter it was merged from (snaketrl.models.merge)."""
    merged_from = Path(model_dir) / MERGED_FROM
    if adapter_dir is None and merged_from.is_file():
        return json.loads(merged_from.read_text())
    return {"model_dir": str(model_dir), "adapter_dir": None if adapter_dir is None else str(adapter_dir)}


def _reference_logps(path, pair_rows: list[dict], model_dir, where: str):
    """This run's base's (chosen, rejected) log-probabilities and their dtype, from the pairs.jsonl of the eval
    job that scored them: the base model's, or for a run started from another run's merged policy, that run's.
    Refused unless that job scored these pairs with the weights this run's base has; None (computed here) when
    the merged policy predates its record of what it was merged from."""
    ref = read_jsonl(path)
    if [r.get("pair_key") for r in ref] != [_pair_key(r) for r in pair_rows]:
        raise DataError(f"{where}: the reference's pairs ({path}) are other pairs; rerun its eval job with the same "
                        f"evaluation.pairs")
    base = _scorer(model_dir)
    scored = [{"model_dir": r.get("model_dir"), "adapter_dir": r.get("adapter_dir")} for r in ref]
    if base["adapter_dir"] is None and any(s["adapter_dir"] for s in scored):
        log.info("%s: %s has no %s; this job computes its pair log-probabilities", where, model_dir, MERGED_FROM)
        return None
    if any(s != base for s in scored):
        raise DataError(f"{where}: the reference's pairs ({path}) were scored by {scored[0]}, not by this run's "
                        f"base {base}")
    return [r["logp_chosen"] for r in ref], [r["logp_rejected"] for r in ref], ref[0].get("dtype") if ref else None


def _same_numbers(reference_logps, dtype: str, model_dir, reference_pairs, where: str):
    """The reference's log-probabilities if this job's reference pass would give the same numbers: the same dtype;
    and for a merged policy, fp32 (its job merged the adapter in memory as the merge rule does on disk; in bf16 an
    unmerged adapter's and merged weights' products differ by more than a run's effect). Else None: computed here."""
    if reference_logps is None:
        return None
    chosen, rejected, theirs = reference_logps
    if theirs != dtype:
        log.info("%s: the reference's pair log-probabilities (%s) were computed in %s; this job computes them in %s",
                 where, reference_pairs, theirs, dtype)
        return None
    if _scorer(model_dir)["adapter_dir"] is not None and dtype != "torch.float32":
        log.info("%s: the reference's pair log-probabilities (%s) came from an unmerged adapter; in %s this job's "
                 "merged weights give other numbers, so it computes them", where, reference_pairs, dtype)
        return None
    return chosen, rejected


# What a diverged model scores as NaN or inf. A NaN reward or KL of one prompt is left out of its mean
# (scoring.mean_std): the log-likelihood metrics are the ones that show it.
HEADLINE = {"nll": ("references", "nll"), "preference accuracy": ("pairs", "accuracy"),
            "logp accuracy": ("pairs", "logp_accuracy"), "margin": ("pairs", "margin"), "kl_k1": ("kl_k1",)}


def check_finite(metrics: dict, target: dict, adapter_dir=None) -> None:
    """Refuse to report a model whose headline metrics (HEADLINE, each score's mean) are NaN or infinite; a run's
    (its adapter in `adapter_dir`) with the advice its training arguments leave (training_advice)."""
    paths = {**HEADLINE, **{f"{score} mean": ("scores", score, "mean") for score in metrics.get("scores", {})}}
    for label, path in paths.items():
        value = metrics
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if not finite(value):
            if target.get("run"):
                raise Diverged(f"evaluation of run '{target['run']}': {label} is {value}; its model diverged in "
                               f"training: train it again ({training_advice(adapter_dir)})")
            raise Diverged(f"evaluation of base model '{target['model']}': {label} is {value}; its weights give "
                           f"non-finite scores")


def training_advice(adapter_dir) -> str:
    """The divergence guard's advice for the run that trained `adapter_dir`, less what its training arguments
    already did (clipping on, bf16 off), as its manifest records them: a run's adapter and manifest.json share
    its directory (snaketrl.paths). HINT where there is no manifest to read."""
    try:
        args = read_json(Path(adapter_dir).parent / "manifest.json")["trl_args"]
        return advice(args["max_grad_norm"], args["bf16"])
    except (TypeError, OSError, ValueError, KeyError):  # TypeError: no adapter_dir
        return HINT


def evaluate(*, target: dict, settings: dict, model_dir, out_completions, out_metrics, adapter_dir=None,
             prompts_file=None, references_file=None, pairs_file=None, reward_models: dict | None = None,
             reference_completions=None, reference_pairs=None, out_pairs=None, lm_eval_data=None,
             reward_model_prompts: dict | None = None, threads: int | None = None) -> dict:
    """One eval job: the model (base + adapter, or a base alone) loaded once; every input checked before it
    loads. `target`: run, model, trainer, seed (snaketrl.config.evaluation.eval_targets). `settings`: the
    checked evaluation section. `reward_models`: run name -> merged directory. `reference_completions`: the
    completions file of the reference's eval job (its base), for win rates; `reference_pairs`: that job's pairs
    file, whose log-probabilities are the base's of a run trained from the base itself. `lm_eval_data`: the
    workflow's copies of the files the project's lm-eval tasks read, in harness.project_task_files order. Writes
    the per-prompt JSON Lines, the per-pair ones (`out_pairs`: empty without pairs) and the metrics JSON, each
    atomically; returns the metrics. `reward_model_prompts`: dataset -> its prepared file, for the reward models
    that judge their own prompts (settings' reward_model_prompts): their completions follow the yardstick's in the
    completions file (prompt_id counting on, `prompt_set` naming the dataset), and each such reward model scores
    those alone."""

    started = time.perf_counter()
    name = target.get("name") or target["run"] or f"base-{target['model']}"
    where = f"evaluate {name}"
    reward_models = dict(reward_models or {})
    gen = settings["generation"]
    lm_tasks = settings["lm_eval"]["tasks"]
    # Every input is checked before the model loads. A chat model reads its prompts as chat turns (target["chat"]:
    # the kinds whose dataset's prompts it reads so; snaketrl.config.evaluation.eval_targets).
    chat = set(target.get("chat", []))
    files = {"prompts": prompts_file, "references": references_file, "pairs": pairs_file}
    rows_of = {kind: _rows(path, kind, settings[kind]["size"], where, f"evaluation.{kind}.size",
                           settings[kind]["dataset"]) for kind, path in files.items() if path}
    rows_of = {kind: as_chat(rows) if kind in chat else rows for kind, rows in rows_of.items()}
    prompts_rows, ref_rows, pair_rows = (rows_of.get(kind) for kind in files)
    sets = judge_prompt_sets(settings)
    set_files = dict(reward_model_prompts or {})
    missing = sorted(sets.keys() - set_files.keys())
    if missing:
        raise ConfigError(f"{where}: no prepared prompts of dataset '{missing[0]}', which a reward model judges on")
    set_rows = {d: _rows(set_files[d], "prompts", p["size"], where, "evaluation.reward_models[].prompts.size", d)
                for d, p in sets.items()}
    set_rows = {d: as_chat(rows) if judge_chat(d) in chat else rows for d, rows in set_rows.items()}
    reference = read_jsonl(reference_completions) if reference_completions else None
    if reference is not None and (prompts_rows is not None or set_rows):
        expected = [(None, _prompt_key(r["prompt"])) for r in prompts_rows or []]
        expected += [(d, _prompt_key(r["prompt"])) for d, rows in set_rows.items() for r in rows]
        if [(r.get(PROMPT_SET), _prompt_key(r["prompt"])) for r in reference] != expected:
            raise DataError(f"{where}: the reference's completions ({reference_completions}) are for other prompts; "
                            f"rerun its eval job with the same evaluation.prompts and reward_models' prompts")
    reference_logps = (_reference_logps(reference_pairs, pair_rows, model_dir, where)
                       if reference_pairs and pair_rows is not None else None)
    manager = lm_eval_task_manager(lm_tasks) if lm_tasks else None
    data_files = dict(zip(project_task_files(lm_tasks), lm_eval_data)) if lm_eval_data else None
    for rm_name, rm_dir in reward_models.items():
        if not (Path(rm_dir) / "config.json").is_file():
            raise ConfigError(f"{where}: reward model '{rm_name}' has no merged model at {rm_dir}")

    timing, metrics = {"checks": time.perf_counter() - started}, {}
    t = time.perf_counter()
    loaded = load_for_eval(model_dir, adapter_dir, threads=threads, trust_remote_code=trusted(target))
    imports_done()
    dtype = str(next(loaded.model.parameters()).dtype)
    reference_logps = _same_numbers(reference_logps, dtype, model_dir, reference_pairs, where)
    for kind, rows in rows_of.items():
        require_template(loaded.tokenizer, rows, kind in chat, model=target["model"], dataset=settings[kind]["dataset"],
                         where=where)
    for dataset, rows in set_rows.items():
        require_template(loaded.tokenizer, rows, judge_chat(dataset) in chat, model=target["model"], dataset=dataset,
                         where=where)
    seed = target.get("seed", 0)
    timing["load"] = time.perf_counter() - t
    rows, pair_logps = [], []
    if prompts_rows is not None:
        t = time.perf_counter()
        prompts = [r["prompt"] for r in prompts_rows]
        generated = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=gen["max_new_tokens"],
                             do_sample=gen["do_sample"], batch_size=gen["batch_size"], temperature=gen["temperature"],
                             top_p=gen["top_p"], seed=seed, logprobs=loaded.has_reference)
        timing["generate"] = time.perf_counter() - t
        t = time.perf_counter()
        kl = kl_to_reference(loaded, generated, batch_size=settings["batch_size"],
                             temperature=gen["temperature"] if gen["do_sample"] else 1.0)
        timing["kl"] = time.perf_counter() - t
        rows = [{"prompt_id": i, "prompt": p, "completion": c, "n_tokens": n}
                for i, (p, c, n) in enumerate(zip(prompts, generated.texts, generated.n_tokens))]
        if kl is not None:
            for row, value in zip(rows, kl):
                row["kl_k1"] = value
        metrics.update(n_prompts=len(rows), mean_length=mean_std(generated.n_tokens)["mean"],
                       distinct_2=distinct_n(generated.texts, 2), kl_k1=mean_std(kl)["mean"] if kl else None,
                       kl_estimator=KL_ESTIMATOR + ("" if gen["do_sample"] else " (greedy: a proxy, not unbiased)"))
    # The reward models' own prompts, after the yardstick's (whose completions, sampled or not, stay as without them).
    judged = {}  # dataset -> its completion rows
    for dataset, set_prompts in set_rows.items():
        t = time.perf_counter()
        g = sets[dataset]["generation"]
        prompts = [r["prompt"] for r in set_prompts]
        out = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=g["max_new_tokens"],
                       do_sample=g["do_sample"], batch_size=g["batch_size"], temperature=g["temperature"],
                       top_p=g["top_p"], seed=seed)
        start = len(rows) + sum(map(len, judged.values()))
        judged[dataset] = [{"prompt_id": start + i, PROMPT_SET: dataset, "prompt": p, "completion": c, "n_tokens": n}
                           for i, (p, c, n) in enumerate(zip(prompts, out.texts, out.n_tokens))]
        timing["generate_judged"] = timing.get("generate_judged", 0.0) + time.perf_counter() - t
    if ref_rows is not None:
        t = time.perf_counter()
        metrics["references"] = completion_nll(loaded.model, loaded.tokenizer, [r["prompt"] for r in ref_rows],
                                               [r["completion"] for r in ref_rows], batch_size=settings["batch_size"])
        timing["nll"] = time.perf_counter() - t
    if pair_rows is not None:
        t = time.perf_counter()
        metrics["pairs"], pair_logps = preference_accuracy(
            loaded, [r["prompt"] for r in pair_rows], [r["chosen"] for r in pair_rows],
            [r["rejected"] for r in pair_rows], batch_size=settings["batch_size"], reference_logps=reference_logps)
        if reference_logps:
            log.info("%s: the reference's pair log-probabilities from its eval job (%s)", where, reference_pairs)
        timing["preference"] = time.perf_counter() - t
    if lm_tasks:
        t = time.perf_counter()
        lm = settings["lm_eval"]
        metrics["lm_eval"] = lm_eval_run(loaded.model, loaded.tokenizer, lm_tasks, limit=lm["limit"],
                                         batch_size=lm["batch_size"], num_fewshot=lm["num_fewshot"], seed=seed,
                                         task_manager=manager, data_files=data_files, chat="lm_eval" in chat)
        timing["lm_eval"] = time.perf_counter() - t
    del loaded

    if prompts_rows is not None or judged:
        t = time.perf_counter()
        scores = {}  # score -> (the rows it scored, their dataset, its values)
        if prompts_rows is not None:
            prompts, texts = [r["prompt"] for r in prompts_rows], [r["completion"] for r in rows]
            columns = {k: [r.get(k) for r in prompts_rows] for k in prompts_rows[0] if k != "prompt"}
            for score, values in reward_function_scores(settings["reward_funcs"], prompts, texts, columns).items():
                scores[score] = rows, settings["prompts"]["dataset"], values
        own = settings.get(JUDGE_PROMPTS, {})
        for rm_name, rm_dir in reward_models.items():
            if rm_name in own:
                dataset = own[rm_name]["dataset"]
                on = judged[dataset]
            elif prompts_rows is not None:
                dataset, on = settings["prompts"]["dataset"], rows
            else:
                continue
            scores[score_name("rm", rm_name)] = on, dataset, reward_model_scores(
                rm_dir, [r["prompt"] for r in on], [r["completion"] for r in on], batch_size=settings["batch_size"],
                trust_remote_code=rm_name in target.get(TRUSTED_JUDGES, []))
        timing["scores"] = time.perf_counter() - t
        metrics["scores"] = {}
        by_id = {r["prompt_id"]: r for r in reference} if reference is not None else None
        for score, (on, dataset, values) in scores.items():
            for row, value in zip(on, values):
                row[score] = value
            entry = mean_std(values)
            entry["win_rate"] = (win_rate(values, [by_id[r["prompt_id"]].get(score) for r in on])
                                 if by_id is not None else None)
            metrics["scores"][score] = {**entry, "n": len(values), "prompts": dataset}

    check_finite(metrics, target, adapter_dir)
    info = {"run": name, "model": target["model"], "trainer": target["trainer"], "seed": seed,
            "reference": target.get("reference")}
    rows = [{**info, **row} for row in rows + [r for done in judged.values() for r in done]]
    timing["total"] = time.perf_counter() - started
    metrics = {**info, **metrics, "timing_s": timing}
    if out_pairs is not None:
        scorer = {**_scorer(model_dir, adapter_dir), "dtype": dtype}
        write_jsonl([{**info, "pair_id": i, "pair_key": _pair_key(r), **scorer, **logps}
                     for i, (r, logps) in enumerate(zip(pair_rows or [], pair_logps))],
                    out_pairs)
    write_jsonl(rows, out_completions)
    write_json(metrics, out_metrics)
    return metrics


def main(argv=None) -> None:
    import sys

    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    print(json.dumps(evaluate(**job), indent=2))


if __name__ == "__main__":
    main()
