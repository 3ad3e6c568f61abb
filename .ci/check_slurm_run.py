"""Jobs really went through sbatch, and the SLURM run's results equal the local run's."""

import json
import re
import sys
from pathlib import Path

from snaketrl import paths

local, slurm, ctld_log = map(Path, sys.argv[1:4])
submitted = re.findall(r"_slurm_rpc_submit_batch_job: JobId=(\d+)", ctld_log.read_text())
logs = sorted((slurm / ".snakemake" / "slurm_logs").rglob("*.log"))
train_logs = [p for p in logs if "rule_train" in str(p)]
print(f"sbatch submissions seen by slurmctld: {len(submitted)}; SLURM job logs: {len(logs)} "
      f"({len(train_logs)} of rule train)")
assert len(submitted) >= 8, "expected the non-local jobs (preprocess, model, lengths, train, plots, report) in SLURM"
assert len(train_logs) == 2, train_logs

for state_file in sorted((local / paths.run_dir("x")).parent.glob("*/trainer_state.json")):
    run = state_file.parent.name
    a = json.loads(state_file.read_text())["log_history"]
    b = json.loads((slurm / paths.run_file(run, "trainer_state.json")).read_text())["log_history"]
    losses_a = [e["loss"] for e in a if "loss" in e]
    losses_b = [e["loss"] for e in b if "loss" in e]
    assert losses_a == losses_b, (run, losses_a[:3], losses_b[:3])
    print(f"{run}: {len(losses_a)} logged losses identical to the local run (last {losses_a[-1]:.4f})")
assert (slurm / paths.report()).is_file()
print("SLURM run matches the local run")
