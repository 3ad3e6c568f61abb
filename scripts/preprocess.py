from snaketrl.data.preprocess import preprocess_splits
from snaketrl.smk import logged

with logged(snakemake):
    preprocess_splits(snakemake.input, snakemake.output, dataset=snakemake.wildcards.dataset,
                      trainer=snakemake.wildcards.trainer, **snakemake.params.mapping)
