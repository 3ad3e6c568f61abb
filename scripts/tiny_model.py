from snaketrl.models.tiny import build_tiny_from_files
from snaketrl.smk import logged

with logged(snakemake):
    tiny = snakemake.params.tiny
    build_tiny_from_files(tiny, snakemake.input.corpus, snakemake.output[0], tiny["seed"], threads=snakemake.threads)
