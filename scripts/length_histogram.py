import json

from snaketrl.data import read_jsonl
from snaketrl.lengths import length_stats, plot_histogram, sequence_lengths
from snaketrl.smk import logged

with logged(snakemake):
    from transformers import AutoConfig, AutoTokenizer

    w = snakemake.wildcards
    tokenizer = AutoTokenizer.from_pretrained(snakemake.input.model)
    cap = getattr(AutoConfig.from_pretrained(snakemake.input.model), "max_position_embeddings", None)
    lengths = sequence_lengths(read_jsonl(snakemake.input.train), tokenizer, snakemake.params.layout)
    stats = length_stats(lengths, **snakemake.params.length, cap=cap, batch_size=snakemake.params.batch_size,
                         seed=snakemake.params.seed)
    plot_histogram(lengths, stats, snakemake.output.png, f"{w.trainer} / {w.dataset} / {w.model}")
    with open(snakemake.output.json, "w") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats, indent=2))
