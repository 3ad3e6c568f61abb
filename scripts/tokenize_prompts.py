from snaketrl.imports import data_job

data_job()  # first: before transformers loads

from snaketrl.data.lengths import tokenize_prompt_files  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

with logged(snakemake):
    tokenize_prompt_files(snakemake.input.model, snakemake.input.lengths,
                          {split: (snakemake.input[split], snakemake.output[split]) for split in ("train", "eval")})
