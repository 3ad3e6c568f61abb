from snaketrl.models import build_tiny_from_files
from snaketrl.smk import logged

with logged(snakemake):
    build_tiny_from_files(snakemake.params.spec, snakemake.input, snakemake.output[0], snakemake.params.seed)
