"""`python -m snaketrl.train JOB.json`: what a multi-GPU job launches in each process."""

from snaketrl.train.run import main

main()
