from snaketrl.report import render
from snaketrl.smk import logged

with logged(snakemake):
    # Every input list holds one file per run, in the order of params.runs.
    inputs = snakemake.input
    keys = ("states", "metrics", "manifests", "curves", "lengths", "histograms", "benchmarks", "summaries")
    files = {run: {key: inputs[key][i] for key in keys} for i, run in enumerate(snakemake.params.runs)}
    render(runs=snakemake.params.runs, files=files, out=snakemake.output[0])
