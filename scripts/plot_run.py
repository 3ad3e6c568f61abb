from snaketrl.plots import plot_run
from snaketrl.smk import logged
from snaketrl.trainers import REGISTRY

with logged(snakemake):
    spec = REGISTRY[snakemake.params.trainer]
    plot_run(snakemake.input[0], snakemake.output.png, snakemake.output.csv, snakemake.wildcards.run,
             first=(spec.overlay, *spec.headline))
