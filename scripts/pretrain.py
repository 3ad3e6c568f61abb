from snaketrl.imports import start_job

start_job()  # first: before peft or transformers load

from snaketrl.models.pretrain import pretrain_model  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

with logged(snakemake):
    out = snakemake.output
    pretrain_model(snakemake.input.init, snakemake.input.corpus, out.model, out.state, out.metrics,
                   snakemake.params.pretrain, threads=snakemake.threads)
