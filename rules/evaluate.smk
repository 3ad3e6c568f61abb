# One yardstick for every run: the same prompts, rewards and judges, each run against its base model.
rule evaluate:
    input:
        unpack(lambda wc: eval_job_inputs(wc.evaluated, EVAL, RUNS, EVAL_TARGETS)),
        lm_eval_data=LM_EVAL_DATA,
    output:
        completions=paths.evaluation("{evaluated}", "completions.jsonl"),
        metrics=paths.evaluation("{evaluated}", "metrics.json"),
        pairs=paths.evaluation("{evaluated}", "pairs.jsonl"),
    log:
        paths.log("evaluate", "{evaluated}"),
    benchmark:
        paths.benchmark("evaluate", "{evaluated}")
    wildcard_constraints:
        evaluated="[^/]+",  # run and base names: one path segment each
    conda:
        "../envs/train.yaml"
    # A tiny model's job takes one thread (it gains nothing from two, and loses much when the cores are shared).
    threads: lambda wc: model_threads(EVAL_TARGETS[wc.evaluated]["model"])
    resources:
        mem_mb=per_attempt(8000),
        runtime=per_attempt(60),
    params:
        target=lambda wc: EVAL_TARGETS[wc.evaluated],
        settings=eval_settings(),
    script:
        "../scripts/evaluate_run.py"


rule collect_evaluation:
    input:
        completions=[paths.evaluation(n, "completions.jsonl") for n in EVAL_TARGETS],
        metrics=[paths.evaluation(n, "metrics.json") for n in EVAL_TARGETS],
        samples=[paths.training_samples(r) for r in report_runs()],
    output:
        paths.evaluation_db(),
    log:
        paths.log("collect_evaluation", "db"),
    conda:
        "../envs/data.yaml"
    params:
        groups=eval_groups(),
    script:
        "../scripts/collect_evaluation.py"
