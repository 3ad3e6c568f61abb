from snaketrl.data.fetch import fetch
from snaketrl.io import write_json, write_jsonl
from snaketrl.smk import logged

with logged(snakemake, offline=False):
    entry = snakemake.params.entry
    if "files" in entry:  # the files as inputs give: a `workflow:` file is the workflow's copy (params keep the name)
        entry = {**entry, "files": {s: f for s in ("train", "eval") if (f := snakemake.input.get(s))}}
    got = fetch(snakemake.wildcards.dataset, entry, entry["seed"])
    write_jsonl(got.train, snakemake.output.train)
    write_jsonl(got.eval, snakemake.output.eval)
    write_json({**got.origin, "dropped": got.dropped.to_json()}, snakemake.output.origin)
    print(f"{len(got.train)} train rows, {len(got.eval)} eval rows, {got.dropped.count} malformed lines dropped")
