rule plot_run:
    input:
        paths.run_file("{run}", "trainer_state.json"),
    output:
        png=report(
            paths.run_file("{run}", "curves.png"),
            category="Training curves",
            subcategory="{run}",
            caption="../report/curves.rst",
        ),
        csv=paths.run_file("{run}", "log_history.csv"),
    log:
        paths.log("plot_run", "{run}"),
    conda:
        "../envs/data.yaml"
    params:
        settings=plot_settings,
    script:
        "../scripts/plot_run.py"


# Lists in the order of report_runs(): the report reads its inputs, never paths of its own.
rule report:
    input:
        states=[paths.run_file(r, "trainer_state.json") for r in report_runs()],
        metrics=[paths.run_file(r, "metrics.json") for r in report_runs()],
        manifests=[paths.run_file(r, "manifest.json") for r in report_runs()],
        curves=[paths.run_file(r, "curves.png") for r in report_runs()],
        lengths=[
            paths.lengths(*(RUNS[r][k] for k in ("trainer", "dataset", "model")))
            for r in report_runs()
        ],
        histograms=[
            paths.lengths(
                *(RUNS[r][k] for k in ("trainer", "dataset", "model")), "png"
            )
            for r in report_runs()
        ],
        benchmarks=[paths.benchmark("train", r) for r in report_runs()],
        summaries=[
            paths.prepared_summary(RUNS[r]["dataset"], RUNS[r]["trainer"])
            for r in report_runs()
        ],
        pretrain_states=[
            paths.pretrain_file(m, "trainer_state.json") for m in pretrained_models()
        ],
        pretrain_metrics=[
            paths.pretrain_file(m, "metrics.json") for m in pretrained_models()
        ],
        eval_metrics=[paths.evaluation(n, "metrics.json") for n in EVAL_TARGETS],
        eval_completions=[
            paths.evaluation(n, "completions.jsonl") for n in EVAL_TARGETS
        ],
        eval_db=[paths.evaluation_db()] if EVAL else [],
    output:
        report(paths.report(), category="Report"),
    log:
        paths.log("report", "report"),
    conda:
        "../envs/data.yaml"
    params:
        runs={r: RUNS[r] for r in report_runs()},
        pretrained=pretrained_models(),
        evaluated=list(EVAL_TARGETS),
        groups=eval_groups(),
    script:
        "../scripts/report.py"
