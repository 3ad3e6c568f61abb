import json
import subprocess
import sys
from pathlib import Path

from snaketrl.smk import logged
from snaketrl.train import launch_command, launch_env, train_run

with logged(snakemake):
    spec = dict(
        run_name=snakemake.wildcards.run, run=snakemake.params.run, config=snakemake.config,
        model_dir=snakemake.input.model, train_file=snakemake.input.train, eval_file=snakemake.input.eval,
        lengths_file=snakemake.input.lengths, reward_dir=snakemake.input.get("reward_model"),
        out_dir=str(Path(snakemake.output.adapter).parent), checkpoint_dir=snakemake.params.checkpoints)
    gpus = int(snakemake.resources.get("gpu", 0) or 0)
    if gpus > 1:
        # More than one GPU in this job: one process per GPU via accelerate, same function.
        spec_file = Path(snakemake.params.checkpoints) / "launch_spec.json"
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        spec_file.write_text(json.dumps(spec, default=str))
        cmd = launch_command(gpus, spec_file)
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr, env=launch_env())  # into the log
    else:
        print(train_run(**spec))
