"""The SFT run retrained through SLURM as one process group of two machines (two SLURM tasks on CI's one node
stand for two nodes): one launcher per task, machine ranks 0 and 1, rendezvous at the allocation's first node;
its losses against the one-process local run's."""

import json
import re
import sys
from pathlib import Path

from snaketrl import paths

local, slurm = map(Path, sys.argv[1:3])
run = "sft-qwen2-tiny"
log = (slurm / paths.log("train", run)).read_text()
launch = next(line for line in log.splitlines() if line.startswith("+ srun "))
print(launch)
assert "--ntasks=2" in launch and "--machine_rank=$SLURM_PROCID" in launch and "--num_machines=2" in launch, launch
for line in log.splitlines():
    if re.search(r"rank [01] snaketrl\.train INFO .*(processes|resuming|first attempt)", line):
        print(line)
assert re.search(r"rank 1 snaketrl\.train INFO sft-qwen2-tiny: 2 processes \(gloo on CPUs\)", log)
metrics = json.loads((slurm / paths.run_file(run, "metrics.json")).read_text())
assert (metrics["processes"], metrics["backend"]) == (2, "gloo"), metrics
one = [e["loss"] for e in json.loads((local / paths.run_file(run, "trainer_state.json")).read_text())["log_history"]
       if "loss" in e]
two = [e["loss"] for e in json.loads((slurm / paths.run_file(run, "trainer_state.json")).read_text())["log_history"]
       if "loss" in e]
assert len(one) == len(two), (one, two)
diffs = [abs(a - b) / abs(a) for a, b in zip(one, two)]
print(f"{run}: 2 machines x 1 process, {metrics['global_batch_note']}; {len(two)} logged losses, relative "
      f"difference to the 1-process run: first {diffs[0]:.1e}, largest {max(diffs):.1e} (epochs whose rows do not "
      f"fill the last global batch end with rows repeated by accelerate)")
