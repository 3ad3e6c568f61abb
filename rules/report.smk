rule plot_run:
    input:
        "results/runs/{run}/trainer_state.json",
    output:
        png=report(
            "results/runs/{run}/curves.png",
            category="Training curves",
            subcategory="{run}",
            caption="../report/curves.rst",
        ),
        csv="results/runs/{run}/log_history.csv",
    params:
        trainer=lambda wc: RUNS[wc.run]["trainer"],
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/plot_run/{run}.log",
    script:
        "../scripts/plot_run.py"


rule report:
    input:
        states=expand("results/runs/{run}/trainer_state.json", run=RUNS),
        metrics=expand("results/runs/{run}/metrics.json", run=RUNS),
        manifests=expand("results/runs/{run}/manifest.json", run=RUNS),
        curves=expand("results/runs/{run}/curves.png", run=RUNS),
        lengths=[
            f"results/lengths/{r['trainer']}/{r['dataset']}/{r['model']}.json"
            for r in RUNS.values()
        ],
        benchmarks=expand("results/benchmarks/train/{run}.tsv", run=RUNS),
    output:
        "results/report.html",
    params:
        runs=RUNS,
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/report.log",
    script:
        "../scripts/report.py"
