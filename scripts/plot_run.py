from snaketrl.report.plots import plot_run
from snaketrl.smk import logged

with logged(snakemake):
    s = snakemake.params.settings
    plot_run(snakemake.input[0], snakemake.output.png, snakemake.output.csv, s["title"], first=s["first"])
