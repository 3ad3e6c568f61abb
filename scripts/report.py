from snaketrl.report.render import render
from snaketrl.smk import logged

with logged(snakemake):
    # Every input list holds one file per run, in the order of params.runs.
    inputs = snakemake.input
    keys = ("states", "metrics", "manifests", "curves", "lengths", "histograms", "benchmarks", "summaries")
    files = {run: {key: inputs[key][i] for key in keys} for i, run in enumerate(snakemake.params.runs)}
    pretrained = {model: {"state": inputs.pretrain_states[i], "metrics": inputs.pretrain_metrics[i]}
                  for i, model in enumerate(snakemake.params.pretrained)}
    evaluated = {job: {"metrics": inputs.eval_metrics[i], "completions": inputs.eval_completions[i]}
                 for i, job in enumerate(snakemake.params.evaluated)}
    render(runs=snakemake.params.runs, files=files, out=snakemake.output[0], pretrained=pretrained,
           evaluated=evaluated, groups=snakemake.params.groups, db=(inputs.eval_db or [None])[0])
