"""`python -m snaketrl.train JOB.json [JOB.json ...]`: what a launched job runs in each of its processes."""

from snaketrl.processes import die_with_parent

die_with_parent()  # first: a launcher killed while this process imports takes it along too

from snaketrl.imports import start_job  # noqa: E402

start_job()  # before peft or transformers load

from snaketrl.train.run import main  # noqa: E402 - after the line above, on purpose

main()
