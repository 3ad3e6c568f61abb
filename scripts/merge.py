from snaketrl.models.merge import merge
from snaketrl.smk import logged

with logged(snakemake):
    merge(snakemake.input.adapter, snakemake.input.base, snakemake.output[0], snakemake.params.settings["task_type"],
          threads=snakemake.threads)
