# A tokenizer trained on the model's corpus and random weights: what pretraining starts from.
rule tiny_model:
    input:
        corpus=tiny_corpus,
    output:
        directory(paths.model_init("{model}")),
    log:
        paths.log("tiny_model", "{model}"),
    conda:
        "../envs/train.yaml"
    params:
        tiny=tiny_entry,
    script:
        "../scripts/tiny_model.py"


# Real post-training starts from a pretrained base: a short causal-LM pretraining on the corpus.
rule pretrain:
    input:
        init=paths.model_init("{model}"),
        corpus=tiny_corpus,
    output:
        model=directory(paths.model("{model}")),
        state=paths.pretrain_file("{model}", "trainer_state.json"),
        metrics=paths.pretrain_file("{model}", "metrics.json"),
    log:
        paths.log("pretrain", "{model}"),
    benchmark:
        paths.benchmark("pretrain", "{model}")
    wildcard_constraints:
        model=_alternatives(TINY_MODELS),
    conda:
        "../envs/train.yaml"
    threads: 1
    resources:
        mem_mb=per_attempt(4000),
        runtime=per_attempt(30),
    params:
        pretrain=pretrain_settings,
    script:
        "../scripts/pretrain.py"


# Cluster nodes often have no internet: downloads (and GGUF conversions) run on the submitting machine.
rule download_model:
    input:
        unpack(model_source),
    output:
        directory(paths.model("{model}")),
    log:
        paths.log("download_model", "{model}"),
    wildcard_constraints:
        model=_alternatives(FETCHED_MODELS),
    localrule: True
    conda:
        "../envs/train.yaml"  # a GGUF file is dequantized with torch
    params:
        entry=lambda wc: canonical(model_source_entry(config["models"][wc.model])),
    script:
        "../scripts/download_model.py"
