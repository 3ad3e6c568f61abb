from snaketrl.data import fetch, write_jsonl
from snaketrl.io import write_json
from snaketrl.smk import logged

with logged(snakemake, offline=False):
    entry = snakemake.params.entry
    train, evals = fetch(snakemake.wildcards.dataset, entry, entry["seed"])
    write_jsonl(train, snakemake.output.train)
    write_jsonl(evals, snakemake.output.eval)
    write_json({}, snakemake.output.origin)
    print(f"{len(train)} train rows, {len(evals)} eval rows")
