# Hub downloads run on the submitting machine: cluster nodes often have no internet.
rule get_dataset:
    input:
        unpack(dataset_source),
    output:
        train=paths.raw("{dataset}", "train"),
        eval=paths.raw("{dataset}", "eval"),
        origin=paths.raw_origin("{dataset}"),
    log:
        paths.log("get_dataset", "{dataset}"),
    localrule: True
    conda:
        "../envs/data.yaml"
    params:
        entry=dataset_fetch,
    script:
        "../scripts/get_dataset.py"


rule preprocess:
    input:
        train=paths.raw("{dataset}", "train"),
        eval=paths.raw("{dataset}", "eval"),
        origin=paths.raw_origin("{dataset}"),
    output:
        train=paths.prepared("{dataset}", "{trainer}", "train"),
        eval=paths.prepared("{dataset}", "{trainer}", "eval"),
        summary=paths.prepared_summary("{dataset}", "{trainer}"),
    log:
        paths.log("preprocess", "{dataset}", "{trainer}"),
    conda:
        "../envs/data.yaml"
    params:
        mapping=dataset_mapping,
    script:
        "../scripts/preprocess.py"


rule length_histogram:
    input:
        model=paths.model("{model}"),
        train=paths.prepared("{dataset}", "{trainer}", "train"),
    output:
        json=paths.lengths("{trainer}", "{dataset}", "{model}"),
        png=report(
            paths.lengths("{trainer}", "{dataset}", "{model}", "png"),
            category="Sequence lengths",
            caption="../report/lengths.rst",
        ),
    log:
        paths.log("length_histogram", "{trainer}", "{dataset}", "{model}"),
    # Seconds, and every train job waits for one.
    priority: 3
    conda:
        "../envs/data.yaml"
    params:
        settings=length_settings,
    script:
        "../scripts/length_histogram.py"


# PPO consumes token ids: prompts cut from the left to the histogram's length, per model tokenizer (as chat turns
# where the histogram, which records it, measured them so).
rule tokenize_prompts:
    input:
        model=paths.model("{model}"),
        train=paths.prepared("{dataset}", "{trainer}", "train"),
        eval=paths.prepared("{dataset}", "{trainer}", "eval"),
        lengths=paths.lengths("{trainer}", "{dataset}", "{model}"),
    output:
        train=paths.tokenized("{dataset}", "{trainer}", "{model}", "train"),
        eval=paths.tokenized("{dataset}", "{trainer}", "{model}", "eval"),
    log:
        paths.log("tokenize_prompts", "{dataset}", "{trainer}", "{model}"),
    priority: 3
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/tokenize_prompts.py"
