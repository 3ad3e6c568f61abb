import json

from snaketrl.data import read_jsonl, write_jsonl
from snaketrl.lengths import tokenize_prompts
from snaketrl.smk import logged

with logged(snakemake):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(snakemake.input.model)
    max_length = json.loads(open(snakemake.input.lengths).read())["max_length"]
    for split in ("train", "eval"):
        rows = tokenize_prompts(read_jsonl(snakemake.input[split]), tokenizer, max_length)
        write_jsonl(rows, snakemake.output[split])
        print(f"{split}: {len(rows)} prompts, at most {max_length} tokens")
