from snaketrl.data import preprocess, read_jsonl, write_jsonl
from snaketrl.io import write_json
from snaketrl.smk import logged

with logged(snakemake):
    m = snakemake.params.mapping
    # Both splits are checked before either is written.
    out = {split: preprocess(read_jsonl(snakemake.input[split]), dataset=snakemake.wildcards.dataset,
                             trainer=snakemake.wildcards.trainer, layout=m["layout"], columns=m["columns"],
                             split=split, format=m["format"])
           for split in ("train", "eval")}
    for split, rows in out.items():
        write_jsonl(rows, snakemake.output[split])
        print(f"{split}: {len(rows)} rows, columns {list(rows[0])}")
    write_json({split: {"rows": len(rows), "dropped": 0} for split, rows in out.items()}, snakemake.output.summary)
