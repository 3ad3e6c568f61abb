from snaketrl.evaluate.storage import collect
from snaketrl.smk import logged

with logged(snakemake):
    print(collect(snakemake.input.completions, snakemake.output[0], metrics_files=snakemake.input.metrics,
                  samples_files=snakemake.input.get("samples", []), groups=snakemake.params.groups))
