"""The CI profile: profiles/slurm with the loopback cluster's partition, no account, no GPU,
and squeue for status (no slurmdbd here, so sacct would hang)."""

import sys
from pathlib import Path

import yaml

src, dest = map(Path, sys.argv[1:3])
profile = yaml.safe_load(src.read_text())
profile.update({"jobs": 4, "slurm-no-account": True, "slurm-status-command": "squeue",
                "slurm-init-seconds-before-status-checks": 2, "slurm-keep-successful-logs": True,
                "latency-wait": 5, "retries": 1})
profile["default-resources"] = {k: v for k, v in profile["default-resources"].items() if k != "slurm_account"}
profile["default-resources"].update(slurm_partition="ci", mem_mb="2000 * attempt", cpus_per_task=1)
for rule, res in profile["set-resources"].items():
    res.update(slurm_partition="ci", mem_mb="6000 * attempt")
    for key in ("gpu", "gpu_model", "cpus_per_gpu"):
        res.pop(key, None)
profile["set-resources"]["train"]["cpus_per_task"] = 1  # as many threads as the local run's train jobs
profile.pop("set-threads", None)  # the local run's one thread per job: losses must match bit for bit
dest.parent.mkdir(parents=True, exist_ok=True)
dest.write_text(yaml.safe_dump(profile, sort_keys=False))
print(dest.read_text())
