from snaketrl.imports import imports_done, start_job

start_job()  # first: before peft or transformers load

from snaketrl.models.download import download  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

imports_done()  # its heavy work is short: collect as usual

with logged(snakemake, offline=False):
    gguf = snakemake.input.get("gguf")  # one file, or its parts
    download(snakemake.wildcards.model, snakemake.params.entry, snakemake.output[0],
             [gguf] if isinstance(gguf, str) else list(gguf or []) or None, snakemake.input.get("chat_template"))
