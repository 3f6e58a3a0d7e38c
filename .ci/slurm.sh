#!/usr/bin/env bash
# CI: a one-node Slurm cluster on this machine, then the Slurm launch tests.
#
#   .ci/slurm.sh [pytest args]      (called from .ci/run; needs root for apt-get and munged)
#
# Installs Debian's munge and Slurm daemons when missing (one apt-get update), starts munged
# (as the munge user), slurmctld and slurmd from a private slurm.conf whose addresses are
# 127.0.0.1, and runs tests/launch/test_slurm.py with SAO_SLURM_TEST=1: a job submitted by
# `sao submit` through launch/slurm/sao.sbatch (the users' script) on one node, whose stand-in
# driver gets the USR1 Slurm sends before the time limit (as SIGINT). The real `sao train` under
# Slurm (a tiny run stopped by USR1, requeued, resumed, reported) runs on the five-node cluster of
# .ci/slurm_multinode.sh. Every daemon started here is stopped by its PID on exit; a munged that
# is already running is used and left alone. Nothing is killed by name.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
PY=${PY:-.venv/bin/python}
[[ -x "$PY" ]] || { echo "ci/slurm: $PY missing; run make test (it builds .venv) first" >&2; exit 1; }
work=$(mktemp -d /tmp/sao-slurm-ci.XXXXXX)
pids=()

log() { printf '[ci/slurm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

cleanup() {
  local rc=$? i pid deadline
  if [[ -n ${SLURM_CONF:-} ]] && command -v scancel >/dev/null; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true # jobs of this private cluster only
    deadline=$((SECONDS + 60))
    while [[ -n $(squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do sleep 2; done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do # reverse start order: slurmd, slurmctld, munged
    pid=${pids[$i]}
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if ((rc != 0)); then
    log "failed (exit $rc); daemon logs:"
    tail -n 20 "$work"/*.log >&2 2>/dev/null || true
  fi
  rm -rf "$work"
  echo "ci: slurm launch test exit=$rc wall=$(($(date +%s) - start))s"
  exit "$rc"
}
trap cleanup EXIT

# 1. Packages (.ci/slurm_packages.sh: munge and Slurm, when missing).
bash .ci/slurm_packages.sh

# 2. munge: reuse a working daemon, else start one as the munge user (no systemd here).
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged already running; using it"
else
  install -d -o munge -g munge -m 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground >"$work/munged.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 30); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then break; fi
    sleep 0.5
  done
  munge -n | unmunge >/dev/null
  log "munged pid ${pids[-1]}"
fi

# 3. slurmctld + slurmd on loopback, private config, state and ports.
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir -p "$work/state" "$work/spool"
cat >"$work/slurm.conf" <<EOF
ClusterName=saoci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
SlurmUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=10
MinJobAge=600
NodeName=saoci NodeHostname=$(hostname) NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=ci Nodes=saoci Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$work/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >"$work/slurmctld.out.log" 2>&1 &
pids+=($!)
slurmd -D -N saoci -f "$SLURM_CONF" >"$work/slurmd.out.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do
  state=$(sinfo -h -n saoci -o %T 2>/dev/null || true)
  if [[ $state == idle ]]; then break; fi
  sleep 1
done
if [[ $state != idle ]]; then
  log "node state '$state' after 60 s"
  exit 1
fi
log "slurmctld pid ${pids[-2]}, slurmd pid ${pids[-1]}: node saoci idle after $(($(date +%s) - start)) s"

# 4. The tests (they submit through `sao submit` and wait with bounded timeouts).
SAO_SLURM_TEST=1 "$PY" -m pytest -q -p no:cacheprovider tests/launch/test_slurm.py "$@"
