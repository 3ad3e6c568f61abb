rule train:
    input:
        unpack(run_inputs),
    output:
        adapter=directory(paths.adapter("{run}")),
        state=paths.run_file("{run}", "trainer_state.json"),
        metrics=paths.run_file("{run}", "metrics.json"),
        manifest=paths.run_file("{run}", "manifest.json"),
        samples=paths.training_samples("{run}"),
    log:
        paths.log("train", "{run}"),
    benchmark:
        paths.benchmark("train", "{run}")
    # Training before evaluation, and the long chains (SFT -> GRPO, reward model -> PPO) first: the short eval jobs
    # fill the cores at the end (on 2 cores, an unordered run left PPO's 400 s alone at its end).
    priority: train_priority
    conda:
        "../envs/train.yaml"
    threads: train_threads
    resources:
        mem_mb=per_attempt(8000),
        runtime=per_attempt(120),
        gpu=0,
    params:
        run=run_of,
        checkpoints=paths.checkpoints("{run}"),
    script:
        "../scripts/train.py"


# A run's adapter merged into its base: another run's starting policy, or the reward model
# PPO and GRPO load as AutoModelForSequenceClassification.
rule merge:
    input:
        adapter=paths.adapter("{run}"),
        base=lambda wc: base_of(run_of(wc)),
    output:
        directory(paths.merged("{run}")),
    log:
        paths.log("merge", "{run}"),
    priority: 3
    conda:
        "../envs/train.yaml"
    threads: run_threads
    resources:
        mem_mb=per_attempt(8000),
    params:
        settings=merge_settings,
    script:
        "../scripts/merge.py"
