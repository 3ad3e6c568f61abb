localrules:
    download_model,


rule tiny_model:
    input:
        corpus=lambda wc: config["models"][wc.model]["tiny"]["corpus"],
    output:
        directory(paths.model("{model}")),
    log:
        paths.log("tiny_model", "{model}"),
    benchmark:
        paths.benchmark("tiny_model", "{model}")
    wildcard_constraints:
        model=_alternatives(TINY_MODELS),
    conda:
        "../envs/train.yaml"
    threads: 2
    params:
        tiny=tiny_entry,
    script:
        "../scripts/tiny_model.py"


# Cluster nodes often have no internet: downloads run on the submitting machine.
rule download_model:
    output:
        directory(paths.model("{model}")),
    log:
        paths.log("download_model", "{model}"),
    wildcard_constraints:
        model=_alternatives(HUB_MODELS),
    conda:
        "../envs/data.yaml"
    params:
        entry=lambda wc: canonical(config["models"][wc.model]),
    script:
        "../scripts/download_model.py"
