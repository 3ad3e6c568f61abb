from snaketrl.data import fetch, write_jsonl
from snaketrl.smk import logged

with logged(snakemake, offline=False):
    train, evals = fetch(snakemake.wildcards.dataset, snakemake.params.entry, snakemake.params.seed)
    write_jsonl(train, snakemake.output.train)
    write_jsonl(evals, snakemake.output.eval)
    print(f"{len(train)} train rows, {len(evals)} eval rows")
