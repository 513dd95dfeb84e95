#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for the Slurm launcher's end-to-end tests.
# Idempotent: installs what is missing, (re)writes our slurm.conf, starts the daemons that are not
# running, then waits until the node takes jobs. Run as root; safe to run again.
#   infra/slurm/local-cluster.sh          # up (about 10 s the first time, under 1 s after)
#   infra/slurm/local-cluster.sh stop     # stop the daemons it started (by their PID files)
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARKER="# Written by mlstm-sentiment infra/slurm/local-cluster.sh"
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid

if [ "$(id -u)" != 0 ]; then
  echo "error: $0 needs root (it installs packages and starts the Slurm daemons)" >&2
  exit 1
fi

running() {  # running PIDFILE: the process its PID file names is alive
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop() {  # stop PIDFILE: SIGTERM to that one process, then wait for it to go
  running "$1" || return 0
  local pid
  pid=$(cat "$1")
  kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  echo "error: process $pid ($1) did not stop" >&2
  return 1
}

if [ "${1:-}" = stop ]; then
  stop "$SLURMD_PID"; stop "$CTLD_PID"; stop "$MUNGE_PID"
  exit 0
fi

if ! command -v sbatch >/dev/null || [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] \
    || [ ! -x /usr/sbin/munged ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge
fi

mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/slurm
chown munge:munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then  # the package makes one; a copied image may lack it
  mungekey --create --keyfile /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
fi

# Never overwrite a slurm.conf someone else wrote: that is a real cluster's.
if [ -e "$CONF" ] && ! grep -qxF "$MARKER" "$CONF"; then
  echo "error: $CONF exists and was not written by $0; refusing to replace it" >&2
  exit 1
fi
# NodeName=localhost: slurmd falls back to it when the host name is not in the file.
# No accounting (sacct answers nothing); KillWait is the grace between scancel's SIGTERM and SIGKILL.
new_conf=$(cat <<CONF
$MARKER
ClusterName=local
SlurmctldHost=localhost
AuthType=auth/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=localhost CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
)
if [ "$(cat "$CONF" 2>/dev/null)" != "$new_conf" ]; then
  printf '%s\n' "$new_conf" > "$CONF"
  # A changed node (CPUs) needs both daemons restarted, not just reconfigured.
  stop "$SLURMD_PID"; stop "$CTLD_PID"
fi

running "$MUNGE_PID" || runuser -u munge -- /usr/sbin/munged
running "$CTLD_PID" || /usr/sbin/slurmctld
running "$SLURMD_PID" || /usr/sbin/slurmd

for _ in $(seq 60); do
  state=$(sinfo -h -n localhost -o %t 2>/dev/null || true)
  case "$state" in
    idle|mix|alloc|comp) echo "slurm: node localhost is $state"; exit 0 ;;
    drain*|down*) scontrol update NodeName=localhost State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "error: the Slurm node did not come up (sinfo: '${state:-no answer}'); see /var/log/slurm/" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
