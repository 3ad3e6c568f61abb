localrules:
    download_model,


rule tiny_model:
    input:
        expand("results/datasets/{dataset}/raw/train.jsonl", dataset=USED_DATASETS),
    output:
        directory("results/models/{model}"),
    wildcard_constraints:
        model=_alternatives(TINY_MODELS),
    params:
        spec=lambda wc: config["models"][wc.model]["tiny"],
        seed=config["seed"],
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/tiny_model/{model}.log",
    script:
        "../scripts/tiny_model.py"


# Cluster nodes often have no internet: downloads run on the submitting machine.
rule download_model:
    output:
        directory("results/models/{model}"),
    wildcard_constraints:
        model=_alternatives(HUB_MODELS),
    params:
        entry=lambda wc: config["models"][wc.model],
    conda:
        "../envs/snaketrl.yaml"
    log:
        "results/logs/download_model/{model}.log",
    script:
        "../scripts/download_model.py"
