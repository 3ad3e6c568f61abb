rule train:
    input:
        unpack(run_inputs),
    output:
        adapter=directory("results/runs/{run}/adapter"),
        state="results/runs/{run}/trainer_state.json",
        metrics="results/runs/{run}/metrics.json",
        manifest="results/runs/{run}/manifest.json",
    params:
        run=run_of,
        # Outside the declared outputs: Snakemake deletes those when a job fails, and a rerun
        # must find the checkpoints to resume from.
        checkpoints=lambda wc: f"results/checkpoints/{wc.run}",
    threads: 2
    resources:
        mem_mb=per_attempt(8000),
        runtime=per_attempt(120),
        gpu=0,
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/train/{run}.log",
    benchmark:
        "results/benchmarks/train/{run}.tsv"
    script:
        "../scripts/train.py"


# A run's adapter merged into its base: another run's starting policy, or the reward model
# PPO and GRPO load as AutoModelForSequenceClassification.
rule merge:
    input:
        adapter="results/runs/{run}/adapter",
    output:
        directory("results/runs/{run}/merged"),
    params:
        model_class=model_class,
    resources:
        mem_mb=per_attempt(8000),
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/merge/{run}.log",
    script:
        "../scripts/merge.py"
