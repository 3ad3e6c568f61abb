from snaketrl.imports import imports_done, start_job

start_job()  # first: before peft or transformers load

from snaketrl.models.tiny import build_tiny_from_files  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

imports_done()  # its heavy work is short: collect as usual

with logged(snakemake):
    tiny = snakemake.params.tiny
    build_tiny_from_files(tiny, snakemake.input.corpus, snakemake.output[0], tiny["seed"], threads=snakemake.threads)
