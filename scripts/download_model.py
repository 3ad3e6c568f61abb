from snaketrl.imports import imports_done, start_job

start_job()  # first: before peft or transformers load

from snaketrl.models.download import download  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

imports_done()  # its heavy work is short: collect as usual

with logged(snakemake, offline=False):
    download(snakemake.wildcards.model, snakemake.params.entry, snakemake.output[0], snakemake.input.get("gguf"))
