#!/usr/bin/env bash
# Start a real single-node SLURM cluster on loopback, run a reduced offline workflow through a
# profile derived from profiles/slurm, check the jobs went through sbatch and that the results
# equal a local run's. Daemons we start are stopped by PID on exit.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/snaketrl-slurm.XXXXXX)
pids=()
conf=/etc/slurm/slurm.conf
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -f "$work/conf.ours" ] && rm -f "$conf"
  return 0
}
trap cleanup EXIT

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge: the key the package made, a socket of our own (root, so --force).
chmod 755 "$work"
mkdir -p "$work/munge"
[ -s /etc/munge/munge.key ] || mungekey --create --force
munged --force --foreground --socket="$work/munge/socket" --pid-file="$work/munge/munged.pid" \
  --log-file="$work/munge/munged.log" --seed-file="$work/munge/seed" &
pids+=($!)
for _ in $(seq 20); do [ -S "$work/munge/socket" ] && break; sleep 0.5; done

host=$(hostname -s)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
mkdir -p "$work/state" "$work/spool" "$work/log"
# Job steps (srun inside a job) look for the config at the default path, not at $SLURM_CONF.
[ -e "$conf" ] && { echo "$conf exists: not overwriting another cluster's config" >&2; exit 1; }
mkdir -p /etc/slurm
touch "$work/conf.ours"
export SLURM_CONF="$conf"
cat > "$SLURM_CONF" <<CONF
ClusterName=snaketrl-ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
slurmctld -D -f "$SLURM_CONF" &
pids+=($!)
slurmd -D -f "$SLURM_CONF" &
pids+=($!)
up=
for _ in $(seq 60); do sinfo -h -o %t 2>/dev/null | grep -q idle && { up=1; break; }; sleep 1; done
[ -n "$up" ] || { echo "SLURM did not come up; slurmctld log:" >&2; tail -20 "$work/log/slurmctld.log" >&2; exit 1; }
sinfo

# The same reduced workflow, once locally and once through SLURM.
reduce='c["matrix"] = {"trainers": ["sft", "dpo"], "models": ["qwen2-tiny"]}; c.pop("evaluation", None); c["trainers"] = {t: c["trainers"][t] for t in ("sft", "dpo")}'
for dest in local slurm; do
  mkdir -p "$work/$dest"
  cp -r "$repo"/{Snakefile,rules,scripts,config,envs,data,report} "$work/$dest/"
  python3 - "$work/$dest/config/config.yaml" "$reduce" <<'PY'
import sys, yaml
path, change = sys.argv[1], sys.argv[2]
c = yaml.safe_load(open(path)); exec(change); yaml.safe_dump(c, open(path, "w"))
PY
done
python3 "$repo/.ci/derive_profile.py" "$repo/profiles/slurm/config.yaml" "$work/profile/config.yaml"

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# Side by side: the SLURM run waits on sbatch and its polls most of the time. Each job's threads are its own
# (the rule's), so its numbers do not depend on what runs beside it.
start=$(date +%s)
(cd "$work/local" && snakemake --cores 2 all > "$work/local.log" 2>&1; echo $? > "$work/local.rc") &
local_run=$!
(cd "$work/slurm" && timeout 900 snakemake --profile "$work/profile" all > "$work/slurm.log" 2>&1 || { tail -40 "$work/slurm.log"; exit 1; })
echo "SLURM run: $(( $(date +%s) - start )) s"
wait "$local_run"
[ "$(cat "$work/local.rc")" = 0 ] || { echo "the local run failed:" >&2; tail -40 "$work/local.log" >&2; exit 1; }
echo "local and SLURM runs: $(( $(date +%s) - start )) s"

python3 "$repo/.ci/check_slurm_run.py" "$work/local" "$work/slurm" "$work/log/slurmctld.log"

# One run across two machines: the SFT run again, its job given two SLURM tasks (on this one node they stand for
# two nodes): one accelerate launcher per task, one gloo group.
start=$(date +%s)
(cd "$work/slurm" && timeout 900 snakemake --profile "$work/profile" --set-resources train:tasks=2 \
  --forcerun results/runs/sft-qwen2-tiny/adapter -- results/runs/sft-qwen2-tiny/adapter \
  > "$work/machines.log" 2>&1 || { tail -40 "$work/machines.log"; tail -60 "$work/slurm/results/logs/train/sft-qwen2-tiny.log"; exit 1; })
echo "SLURM run across two machines: $(( $(date +%s) - start )) s"
python3 "$repo/.ci/check_slurm_machines.py" "$work/local" "$work/slurm"
