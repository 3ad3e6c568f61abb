import json
import subprocess
import sys
from pathlib import Path

from snaketrl.smk import logged
from snaketrl.train.distributed import check_launcher, job_gpus, launch_command
from snaketrl.train.run import launch_env, train_run

with logged(snakemake):
    run = snakemake.params.run
    job = dict(run=run, model_dir=snakemake.input.model, train_file=snakemake.input.train,
               eval_file=snakemake.input.eval, lengths_file=snakemake.input.lengths,
               reward_dir=snakemake.input.get("reward_model"), out_dir=str(Path(snakemake.output.adapter).parent),
               checkpoint_dir=snakemake.params.checkpoints, threads=snakemake.threads)
    gpus = job_gpus(snakemake.resources)
    if gpus > 1:
        # More than one GPU in this job: one process per GPU via accelerate, in the run's mode; same function.
        check_launcher(run["distributed"], run["name"])
        job_file = Path(snakemake.params.checkpoints) / "launch_job.json"
        job_file.parent.mkdir(parents=True, exist_ok=True)
        job_file.write_text(json.dumps(job, default=str))
        cmd = launch_command(gpus, job_file, snakemake.input.accelerate)
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr, env=launch_env())  # into the log
    else:
        print(train_run(**job))
