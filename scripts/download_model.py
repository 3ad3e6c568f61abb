from snaketrl.imports import skip_bitsandbytes_without_cuda

skip_bitsandbytes_without_cuda()  # first: before peft or transformers load

from snaketrl.models.download import download  # noqa: E402
from snaketrl.smk import logged  # noqa: E402

with logged(snakemake, offline=False):
    download(snakemake.wildcards.model, snakemake.params.entry, snakemake.output[0], snakemake.input.get("gguf"))
