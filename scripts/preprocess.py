from snaketrl.data import preprocess, read_jsonl, write_jsonl
from snaketrl.smk import logged

with logged(snakemake):
    # Both splits are checked before either is written.
    out = {split: preprocess(read_jsonl(snakemake.input[split]), dataset=snakemake.wildcards.dataset,
                             trainer=snakemake.wildcards.trainer, layout=snakemake.params.layout,
                             columns=snakemake.params.columns, split=split,
                             format=snakemake.params.format)
           for split in ("train", "eval")}
    for split, rows in out.items():
        write_jsonl(rows, snakemake.output[split])
        print(f"{split}: {len(rows)} rows, columns {list(rows[0])}")
