from snaketrl.imports import data_job

data_job()  # first: before transformers loads

from snaketrl.data.lengths import histogram  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

with logged(snakemake):
    w = snakemake.wildcards
    histogram(snakemake.input.model, snakemake.input.train, snakemake.params.settings, snakemake.output.json,
              snakemake.output.png, title=f"{w.trainer} / {w.dataset} / {w.model}", model=w.model, dataset=w.dataset)
