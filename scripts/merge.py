from snaketrl.smk import logged
from snaketrl.train import merge

with logged(snakemake):
    merge(snakemake.input.adapter, snakemake.output[0], snakemake.params.model_class)
