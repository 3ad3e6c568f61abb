from snaketrl.imports import start_job

start_job()  # first: before peft or transformers load

from snaketrl.models.merge import merge  # noqa: E402
from snaketrl.remote_code import trusted  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

with logged(snakemake):
    settings = snakemake.params.settings
    merge(snakemake.input.adapter, snakemake.input.base, snakemake.output[0], settings["task_type"],
          threads=snakemake.threads, trust_remote_code=trusted(settings))
