from pathlib import Path

from snaketrl.report import render
from snaketrl.smk import logged

with logged(snakemake):
    render(runs=snakemake.params.runs, results=Path(snakemake.output[0]).parent, out=snakemake.output[0])
