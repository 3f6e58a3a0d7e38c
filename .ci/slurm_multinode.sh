#!/usr/bin/env bash
# CI: a five-node Slurm cluster on this one machine, then the multi-node launch tests.
#
#   .ci/slurm_multinode.sh [pytest args]     (called from .ci/run after the suite, beside .ci/slurm.sh; needs root)
#
# Each node is a network namespace sao-nN with address 10.200.0.N on a private bridge sao-br0
# (the host side holds 10.200.0.254, where slurmctld listens, named sao-ctl), plus its own UTS
# namespace (hostname nN) and mount namespace (an /etc/hosts naming every node and node-local
# scratch at $work/tmp, both bind-mounted there only, as on a real node). One `slurmd -N nN` runs
# per node; a private munged's unix socket is on the shared filesystem, so it serves every node.
# Each node has one CPU as Slurm (and so Ray) sees it: with one Ray CPU per trainer rank the
# 2-rank actor world must span n1+n2, the critic runs on n3, and one TP=2 engine spans n4+n5.
# Then runs tests/launch/test_slurm_multinode.py with SAO_SLURM_MULTINODE_TEST=1.
# Install and daemon handling follow .ci/slurm.sh. Everything started here is stopped by its PID
# on exit; namespaces, veths and the bridge are deleted by the names created here.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
PY=${PY:-.venv/bin/python}
[[ -x "$PY" ]] || { echo "ci/slurm-multinode: $PY missing; run make test (it builds .venv) first" >&2; exit 1; }
NODES=(n1 n2 n3 n4 n5)
BRIDGE=sao-br0 NET=10.200.0 CTLD_IP=10.200.0.254
work=$(mktemp -d /tmp/sao-mn.XXXXXX) # short: Ray socket paths under it must stay < 108 chars
pids=() made_ns=() made_bridge=0

log() { printf '[ci/slurm-mn %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

cleanup() {
  local rc=$? i pid deadline ns
  if [[ -n ${test_pid:-} ]] && kill -0 "$test_pid" 2>/dev/null; then
    kill -TERM "$test_pid" 2>/dev/null || true
    wait "$test_pid" 2>/dev/null || true
  fi
  if [[ -n ${SLURM_CONF:-} ]] && command -v scancel >/dev/null; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true # jobs of this private cluster only
    deadline=$((SECONDS + 60))
    while [[ -n $(squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do sleep 2; done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do # reverse start order: slurmds, slurmctld, munged
    kill -TERM "${pids[$i]}" 2>/dev/null || true
  done
  deadline=$((SECONDS + 20)) # one deadline for all: they stop in parallel
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for ns in "${made_ns[@]}"; do ip netns del "$ns" 2>/dev/null || true; done # takes its veth pair along
  if ((made_bridge)); then ip link del "$BRIDGE" 2>/dev/null || true; fi
  if ((rc != 0)); then
    log "failed (exit $rc); daemon logs:"
    tail -n 20 "$work"/*.log >&2 2>/dev/null || true
  fi
  rm -rf "$work"
  echo "ci: slurm multi-node test exit=$rc wall=$(($(date +%s) - start))s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM # through cleanup, with a failing status
trap 'exit 130' INT

# 1. Packages (.ci/slurm_packages.sh: munge and Slurm, when missing; iproute2 and util-linux are base).
bash .ci/slurm_packages.sh

# 2. The network: a private bridge, one namespace per node joined to it by a veth pair.
for ns in "${NODES[@]/#/sao-}"; do
  if ip netns list | grep -qw "$ns"; then log "namespace $ns already exists (another run?); not touching it"; exit 1; fi
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then log "link $BRIDGE already exists (another run?)"; exit 1; fi
ip link add "$BRIDGE" type bridge
made_bridge=1
ip addr add "$CTLD_IP/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
hosts=$work/hosts
printf '127.0.0.1 localhost\n' >"$hosts"
for i in "${!NODES[@]}"; do
  node=${NODES[$i]} ns=sao-${NODES[$i]} ip=$NET.$((i + 1))
  ip netns add "$ns"
  made_ns+=("$ns")
  ip link add "sao-v$node" type veth peer name eth0 netns "$ns"
  ip link set "sao-v$node" master "$BRIDGE"
  ip link set "sao-v$node" up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  printf '%s %s\n' "$ip" "$node" >>"$hosts"
done
printf '%s sao-ctl\n' "$CTLD_IP" >>"$hosts"

# 3. munge: a private munged (own socket, pid, seed and log files; the host's key) that no other
# run can stop under us; slurm.conf points Slurm at its socket (AuthInfo), so do the tests' jobs.
if [[ ! -s /etc/munge/munge.key ]]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
chmod 0755 "$work"
install -d -o munge -g munge -m 0755 "$work/munge"
munge_socket=$work/munge/munge.socket
setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground --socket="$munge_socket" \
  --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/munged.seed" \
  --log-file="$work/munge/munged.log" >"$work/munged.log" 2>&1 &
pids+=($!)
for _ in $(seq 30); do
  if munge -S "$munge_socket" -n 2>/dev/null | unmunge -S "$munge_socket" >/dev/null 2>&1; then break; fi
  sleep 0.5
done
munge -S "$munge_socket" -n | unmunge -S "$munge_socket" >/dev/null
log "munged pid ${pids[-1]} on $munge_socket"

# 4. slurmctld on the bridge address (host namespace), one slurmd per node namespace.
ctld_port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('$CTLD_IP', 0)); print(s.getsockname()[1])")
mkdir -p "$work/state" "$work/tmp"
node_lines=$(for i in "${!NODES[@]}"; do
  printf 'NodeName=%s NodeAddr=%s.%s NodeHostname=%s CPUs=1 State=UNKNOWN\n' \
    "${NODES[$i]}" "$NET" $((i + 1)) "${NODES[$i]}"
done)
cat >"$work/slurm.conf" <<EOF
ClusterName=saomn
SlurmctldHost=sao-ctl($CTLD_IP)
SlurmctldPort=$ctld_port
SlurmdPort=6818
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
AuthInfo=socket=$munge_socket
SlurmUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool-%n
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd-%n.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
MinJobAge=600
$node_lines
PartitionName=ci Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$work/slurm.conf
# slurmctld binds the address its own hostname resolves to (NoCtldInAddrAny): its UTS and mount
# namespaces name it sao-ctl = the bridge address, so it listens there only, never on the host's.
# shellcheck disable=SC2016 # $1..$2 expand in the inner sh
unshare --uts --mount sh -c 'hostname sao-ctl && mount --bind "$1" /etc/hosts && exec slurmctld -D -i -f "$2"' \
  sh "$hosts" "$SLURM_CONF" >"$work/slurmctld.out.log" 2>&1 &
pids+=($!)
for node in "${NODES[@]}"; do
  # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd then finds no cgroup fs.
  # nsenter, unshare and sh each exec the next, so $! is slurmd's own PID. $work/tmp is node-local
  # scratch, as /tmp is on a real node (Ray's --temp-dir: raylets sharing one directory race for
  # the same socket names and fail with "bind: Address already in use"). Each node has its own
  # /dev/shm, as real nodes do: SGLang tells a peer rank on the same node by a shared-memory segment
  # it can open, and an engine over two nodes that shared one took its peer for a local rank and
  # waited for it on its own loopback forever.
  mkdir -p "$work/spool-$node" "$work/tmp-$node"
  # shellcheck disable=SC2016 # $1..$5 expand in the inner sh
  nsenter --net="/run/netns/sao-$node" unshare --uts --mount sh -c \
    'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$4" "$5" &&
     mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec slurmd -D -N "$1" -f "$3"' \
    sh "$node" "$hosts" "$SLURM_CONF" "$work/tmp-$node" "$work/tmp" >"$work/slurmd-$node.out.log" 2>&1 &
  pids+=($!)
done
want="idle ${#NODES[@]}"
for _ in $(seq 60); do
  state=$(sinfo -h -o '%T %D' 2>/dev/null || true)
  if [[ $state == "$want" ]]; then break; fi
  sleep 1
done
if [[ $state != "$want" ]]; then
  log "node states '$state' after 60 s (want '$want')"
  sinfo -N >&2 || true
  exit 1
fi
log "slurmctld on $CTLD_IP:$ctld_port, slurmd pids ${pids[*]: -${#NODES[@]}}: ${#NODES[@]} nodes idle after $(($(date +%s) - start)) s"

# 5. The tests (they submit through `sao submit` and wait with bounded timeouts).
# In the background so that a TERM or INT reaches the trap at once (bash defers traps while a
# foreground command runs); cleanup stops pytest by its PID.
SAO_SLURM_MULTINODE_TEST=1 SAO_NODE_TMP=$work/tmp "$PY" -m pytest -q -p no:cacheprovider \
  tests/launch/test_slurm_multinode.py "$@" &
test_pid=$!
wait "$test_pid"
