from snaketrl.smk import logged
from snaketrl.train import merge

with logged(snakemake):
    merge(snakemake.input.adapter, snakemake.input.base, snakemake.output[0], snakemake.params.settings["task_type"],
          threads=snakemake.threads)
