from snaketrl.data.lengths import histogram
from snaketrl.smk import logged

with logged(snakemake):
    w = snakemake.wildcards
    histogram(snakemake.input.model, snakemake.input.train, snakemake.params.settings, snakemake.output.json,
              snakemake.output.png, title=f"{w.trainer} / {w.dataset} / {w.model}", model=w.model, dataset=w.dataset)
