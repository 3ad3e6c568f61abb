from snaketrl.models.download import download
from snaketrl.smk import logged

with logged(snakemake, offline=False):
    download(snakemake.wildcards.model, snakemake.params.entry, snakemake.output[0], snakemake.input.get("gguf"))
