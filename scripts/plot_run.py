from snaketrl.plots import plot_run
from snaketrl.smk import logged

with logged(snakemake):
    plot_run(snakemake.input[0], snakemake.output.png, snakemake.output.csv, snakemake.wildcards.run)
