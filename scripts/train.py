import os
from pathlib import Path

from snaketrl.imports import start_job

start_job()  # first: before peft or transformers load

from snaketrl.errors import ConfigError  # noqa: E402
from snaketrl.io import write_json  # noqa: E402
from snaketrl.smk import logged  # noqa: E402
from snaketrl.train import distributed  # noqa: E402
from snaketrl.train.run import train_run  # noqa: E402

with logged(snakemake):
    run = snakemake.params.run
    job = dict(run=run, model_dir=snakemake.input.model, train_file=snakemake.input.train,
               eval_file=snakemake.input.eval, lengths_file=snakemake.input.lengths,
               reward_dir=snakemake.input.get("reward_model"), out_dir=str(Path(snakemake.output.adapter).parent),
               checkpoint_dir=snakemake.params.checkpoints, threads=snakemake.threads,
               mem_mb=snakemake.resources.get("mem_mb"))
    plan = distributed.plan(run, snakemake.resources)
    if plan.launched:
        # One process per GPU, or the run's processes on CPUs, as one group via accelerate; same function.
        distributed.check_launcher(run["distributed"], run["name"], plan)
        job["threads"] = max(1, snakemake.threads // plan.processes)
        if job["mem_mb"]:  # a machine's (SLURM: a node's), split among its processes
            job["mem_mb"] = job["mem_mb"] // plan.processes
        job_file = Path(snakemake.params.checkpoints) / "launch_job.json"
        write_json(job, job_file)
        if plan.machines == 1:
            cmd = distributed.launch_command(plan, job_file, snakemake.input.accelerate, port=distributed.free_port())
        elif "SLURM_JOB_NODELIST" in os.environ:
            cmd = distributed.slurm_command(plan, job_file, snakemake.input.accelerate, distributed.free_port())
        else:
            raise ConfigError(f"config: run '{run['name']}': nodes: {plan.machines} in the train rule's resources "
                              f"launches one process group across SLURM nodes, and this job runs outside SLURM "
                              f"(no SLURM_JOB_NODELIST); docs/cluster.md says how other engines launch one")
        print(f"{run['name']}: {plan.describe()}", flush=True)
        print("+", " ".join(cmd), flush=True)
        distributed.run_launch(cmd, distributed.launch_env(plan, job["threads"], run["distributed"]), run["name"])
    else:
        print(train_run(**job))
