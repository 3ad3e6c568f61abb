from snaketrl.data.lengths import tokenize_prompt_files
from snaketrl.smk import logged

with logged(snakemake):
    tokenize_prompt_files(snakemake.input.model, snakemake.input.lengths,
                          {split: (snakemake.input[split], snakemake.output[split]) for split in ("train", "eval")})
