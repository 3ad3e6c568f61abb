from snaketrl.smk import logged
from snaketrl.train import train_run

with logged(snakemake):
    metrics = train_run(
        run_name=snakemake.wildcards.run, run=snakemake.params.run, config=snakemake.config,
        model_dir=snakemake.input.model, train_file=snakemake.input.train, eval_file=snakemake.input.eval,
        lengths_file=snakemake.input.lengths, reward_dir=snakemake.input.get("reward_model"),
        out_dir=snakemake.output.adapter.rsplit("/", 1)[0], checkpoint_dir=snakemake.params.checkpoints)
    print(metrics)
