# Hub downloads run on the submitting machine: cluster nodes often have no internet.
localrules:
    get_dataset,


rule get_dataset:
    output:
        train="results/datasets/{dataset}/raw/train.jsonl",
        eval="results/datasets/{dataset}/raw/eval.jsonl",
    params:
        entry=lambda wc: config["datasets"][wc.dataset],
        seed=config["seed"],
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/get_dataset/{dataset}.log",
    script:
        "../scripts/get_dataset.py"


rule preprocess:
    input:
        train="results/datasets/{dataset}/raw/train.jsonl",
        eval="results/datasets/{dataset}/raw/eval.jsonl",
    output:
        train="results/datasets/{dataset}/{trainer}/train.jsonl",
        eval="results/datasets/{dataset}/{trainer}/eval.jsonl",
    params:
        layout=lambda wc: REGISTRY[wc.trainer].layout,
        columns=lambda wc: config["datasets"][wc.dataset]["columns"],
        format=lambda wc: config["datasets"][wc.dataset]["format"],
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/preprocess/{dataset}/{trainer}.log",
    script:
        "../scripts/preprocess.py"


rule length_histogram:
    input:
        model="results/models/{model}",
        train="results/datasets/{dataset}/{trainer}/train.jsonl",
    output:
        json="results/lengths/{trainer}/{dataset}/{model}.json",
        png=report(
            "results/lengths/{trainer}/{dataset}/{model}.png",
            category="Sequence lengths",
            caption="../report/lengths.rst",
        ),
    params:
        layout=lambda wc: REGISTRY[wc.trainer].layout,
        length=config["length"],
        batch_size=length_batch_size,
        seed=config["seed"],
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/length_histogram/{trainer}/{dataset}/{model}.log",
    script:
        "../scripts/length_histogram.py"


# PPO consumes token ids: prompts cut from the left to the histogram's length, per model tokenizer.
rule tokenize_prompts:
    input:
        model="results/models/{model}",
        train="results/datasets/{dataset}/{trainer}/train.jsonl",
        eval="results/datasets/{dataset}/{trainer}/eval.jsonl",
        lengths="results/lengths/{trainer}/{dataset}/{model}.json",
    output:
        train="results/datasets/{dataset}/{trainer}/{model}/train.jsonl",
        eval="results/datasets/{dataset}/{trainer}/{model}/eval.jsonl",
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/tokenize_prompts/{dataset}/{trainer}/{model}.log",
    script:
        "../scripts/tokenize_prompts.py"
