#!/usr/bin/env bash
# A real one-node Slurm on this machine for the slurm backend's tests: munge, slurmctld and slurmd started
# directly (no systemd), one node with two GPU GRES types over stand-in device files (two rtx3090, one
# rtx5080: the three cards of examples/local-slurm.toml run at once, a second rtx5080 job waits),
# proctrack/linuxproc, task/none. Idempotent: daemons already answering with this config are left alone; a
# changed config restarts only the daemons this script started (by their pid files). Needs root.
#
# The config is written to /etc/slurm/slurm.conf (where every Slurm client looks) with a marker line; a
# slurm.conf without the marker is somebody's real cluster config and is never overwritten.
set -euo pipefail
MARK="# written by runner scripts/slurm-local.sh"
ETC=/etc/slurm
STATE=/var/lib/runner-slurm
RUN=/run/runner-slurm
LOG=/var/log/runner-slurm
NODE=$(hostname -s)

need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

mkdir -p "$ETC" "$STATE/ctld" "$STATE/d" "$RUN/dev" "$LOG"
# Stand-in GPUs: slurmd wants a character device per GPU (it never opens it); the numbers are the NVIDIA
# driver's (major 195), so jobs get CUDA_VISIBLE_DEVICES as on a real node. No driver is behind them.
for i in 0 1 2; do
  [ -c "$RUN/dev/nvidia$i" ] || { rm -f "$RUN/dev/nvidia$i"; mknod "$RUN/dev/nvidia$i" c 195 "$i"; }
done

# --- munge (authentication between the Slurm commands and daemons) ---
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  rm -f /run/munge/munged.pid
  if getent passwd munge >/dev/null; then runuser -u munge -- munged; else munged --force; fi
  for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
  munge -n | unmunge >/dev/null || { echo "munged did not start" >&2; exit 1; }
fi

# --- the config ---
conf=$(mktemp)
cat >"$conf" <<EOF
$MARK (a local test cluster; safe to delete)
ClusterName=runner-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
# The stand-in node declares more CPUs than this machine has: two lanes, each a server step and a meter step.
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=600
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 Gres=gpu:rtx3090:2,gpu:rtx5080:1 State=UNKNOWN
# Preemption for real: a job in 'urgent' cancels what holds its resources in 'debug' (the runner must record
# that as preempted, never as an out-of-memory).
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=$NODE MaxTime=INFINITE State=UP PriorityTier=10
EOF
gres=$(mktemp)
cat >"$gres" <<EOF
$MARK
NodeName=$NODE Name=gpu Type=rtx3090 File=$RUN/dev/nvidia[0-1]
NodeName=$NODE Name=gpu Type=rtx5080 File=$RUN/dev/nvidia2
EOF
if [ -e "$ETC/slurm.conf" ] && ! grep -qF "$MARK" "$ETC/slurm.conf"; then
  echo "$ETC/slurm.conf exists and was not written by this script: not touching a real cluster's config" >&2
  exit 1
fi

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
changed=0
cmp -s "$conf" "$ETC/slurm.conf" || changed=1
cmp -s "$gres" "$ETC/gres.conf" || changed=1
if [ "$changed" = 1 ]; then
  for d in slurmd slurmctld; do
    if alive "$RUN/$d.pid"; then
      pid=$(cat "$RUN/$d.pid"); kill "$pid"
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
  done
  install -m 0644 "$conf" "$ETC/slurm.conf"
  install -m 0644 "$gres" "$ETC/gres.conf"
fi
rm -f "$conf" "$gres"
alive "$RUN/slurmctld.pid" || slurmctld
alive "$RUN/slurmd.pid" || slurmd

# --- wait for the node ---
state=""
for _ in $(seq 60); do
  # a daemon that forked may not have written its pid file yet: wait for it rather than give up at once
  alive "$RUN/slurmctld.pid" && alive "$RUN/slurmd.pid" || { sleep 1; continue; }
  state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
  case "$state" in
    idle*|mix*|alloc*) break ;;
    down*|drain*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
  esac
  sleep 1
done
case "$state" in
  idle*|mix*|alloc*) echo "slurm $(sinfo -V | cut -d' ' -f2) up: node $NODE $state, gres $(sinfo -h -n "$NODE" -o %G)" ;;
  *) echo "slurm node $NODE is '$state'"; tail -n 20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2; exit 1 ;;
esac
