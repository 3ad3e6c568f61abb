from snaketrl.data import fetch, write_jsonl
from snaketrl.io import write_json
from snaketrl.smk import logged

with logged(snakemake, offline=False):
    entry = snakemake.params.entry
    got = fetch(snakemake.wildcards.dataset, entry, entry["seed"])
    write_jsonl(got.train, snakemake.output.train)
    write_jsonl(got.eval, snakemake.output.eval)
    write_json({**got.origin, "dropped": got.dropped.to_json()}, snakemake.output.origin)
    print(f"{len(got.train)} train rows, {len(got.eval)} eval rows, {got.dropped.count} malformed lines dropped")
