from snaketrl.models.pretrain import pretrain_model
from snaketrl.smk import logged

with logged(snakemake):
    out = snakemake.output
    pretrain_model(snakemake.input.init, snakemake.input.corpus, out.model, out.state, out.metrics,
                   snakemake.params.pretrain, threads=snakemake.threads)
