# Shared by launch/local.sh and launch/slurm/sao.sbatch: sourced, never executed.
# Functions only; nothing runs at source time. Processes are stopped by the PIDs recorded when
# they were started, never by name.
# shellcheck shell=bash

SAO_PIDS=()

sao_log() {
  printf '[sao-launch %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2
}

# sao_quote WORD...: the words as one shell command line (single quotes only where needed).
sao_quote() {
  local word out=()
  for word in "$@"; do
    if [[ $word =~ ^[][A-Za-z0-9_./:=,%@+-]+$ ]]; then
      out+=("$word")
    else
      out+=("'${word//\'/\'\\\'\'}'")
    fi
  done
  printf '%s' "${out[*]}"
}

# sao_cmd LOG CMD...: run CMD in the background with stdout+stderr in LOG (LOG "-": inherit)
# and record its PID in SAO_PIDS and SAO_LAST_PID. With SAO_DRY_RUN=1 print it instead.
sao_cmd() {
  local log=$1
  shift
  if [[ ${SAO_DRY_RUN:-0} == 1 ]]; then
    sao_quote "$@"
    if [[ $log != - ]]; then printf ' > %s 2>&1' "$(sao_quote "$log")"; fi
    printf ' &\n'
    SAO_LAST_PID=0
    return
  fi
  if [[ $log == - ]]; then
    "$@" &
  else
    "$@" >"$log" 2>&1 &
  fi
  SAO_LAST_PID=$!
  SAO_PIDS+=("$SAO_LAST_PID")
}

# sao_ray_auth DIR: Ray token authentication for this job (Ray >= 2.52: RAY_AUTH_MODE=token), so
# nobody else on the network can drive the cluster: a fresh random token in DIR/ray_auth_token
# (mode 600; DIR on the filesystem every node shares), exported as RAY_AUTH_TOKEN_PATH for `ray start`,
# `ray status` and the driver. RAY_AUTH_MODE=disabled set by the caller turns it off. With
# SAO_DRY_RUN=1 prints the exports instead.
sao_ray_auth() {
  local dir=$1
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
  if [[ $RAY_AUTH_MODE != token ]]; then
    sao_log "Ray token authentication off (RAY_AUTH_MODE=$RAY_AUTH_MODE): anyone who reaches the head's port can submit work"
    return
  fi
  export RAY_AUTH_TOKEN_PATH=$dir/ray_auth_token
  if [[ ${SAO_DRY_RUN:-0} == 1 ]]; then
    printf 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=%s  # a fresh random token, mode 600\n' \
      "$(sao_quote "$RAY_AUTH_TOKEN_PATH")"
    return
  fi
  mkdir -p "$dir"
  (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH")
}

# sao_ray_resources GROUP UNITS: the custom Ray resources of a node in GROUP (actor, critic,
# rollout, or shared = all three), UNITS each (GPUs per node, or 1 on CPU-only nodes).
sao_ray_resources() {
  local group=$1 units=$2
  if [[ $group == shared ]]; then
    printf '{"sao_actor": %s, "sao_critic": %s, "sao_rollout": %s}' "$units" "$units" "$units"
  else
    printf '{"sao_%s": %s}' "$group" "$units"
  fi
}

# sao_wait_ray ADDRESS NODES TIMEOUT_S [PID...]: until NODES nodes are alive in the Ray cluster;
# fails at once when one of the PIDs (the `ray start` processes or their srun steps) has exited.
# `ray status` runs behind SAO_RAY_STATUS_PREFIX (an array; the container's srun/apptainer prefix).
SAO_RAY_STATUS_PREFIX=()
sao_wait_ray() {
  local address=$1 want=$2 timeout=$3 start=$SECONDS have=0 pid status=("${SAO_RAY_STATUS_PREFIX[@]}" ray status)
  shift 3
  if [[ ${SAO_DRY_RUN:-0} == 1 ]]; then
    printf '# wait (at most %ss) until %s --address=%s lists %s nodes\n' "$timeout" "$(sao_quote "${status[@]}")" \
      "$address" "$want"
    return
  fi
  while ((SECONDS - start < timeout)); do
    have=$(timeout $((${#SAO_RAY_STATUS_PREFIX[@]} ? 120 : 30)) "${status[@]}" --address="$address" 2>/dev/null |
      grep -c ' node_' || true)
    if ((have >= want)); then
      sao_log "Ray cluster at $address: $have node(s) alive after $((SECONDS - start)) s"
      return 0
    fi
    for pid in "$@"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        sao_log "a Ray daemon (pid $pid) exited before the cluster was up; see the ray-*.log files"
        return 1
      fi
    done
    sleep 2
  done
  sao_log "Ray cluster at $address: $have of $want node(s) after ${timeout} s; see the ray-*.log files"
  return 1
}

# sao_stop_pids PID...: SIGTERM each recorded PID, wait up to 30 s, then SIGKILL what is left.
sao_stop_pids() {
  local pid deadline=$((SECONDS + 30))
  for pid in "$@"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "$@"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
}

# sao_run_driver LOG CMD...: run the driver (`sao train ...`) in the background, forward USR1,
# TERM and INT to it as SAO_STOP_SIGNAL (default INT: `sao train` then checkpoints in its
# `finally:` and exits), wait for it and return its exit status. Background commands of a
# script start with SIGINT ignored, and Python then installs no KeyboardInterrupt handler:
# `env --default-signal=INT` restores the default first.
sao_run_driver() {
  local log=$1 rc daemons=("${SAO_PIDS[@]}")
  shift
  SAO_DRIVER_PID="" SAO_PENDING_SIGNAL=""
  if [[ ${SAO_DRY_RUN:-0} != 1 ]]; then
    # Trapped before the driver starts: a signal that arrives while it starts is held until its
    # PID is known, then forwarded (trapped after the start, it ended this shell, orphaning the driver).
    trap 'sao_forward USR1' USR1
    trap 'sao_forward TERM' TERM
    trap 'sao_forward INT' INT
  fi
  sao_cmd "$log" env --default-signal=INT "$@"
  SAO_PIDS=("${daemons[@]}") # the driver is waited for here, never stopped by sao_stop_pids
  if [[ ${SAO_DRY_RUN:-0} == 1 ]]; then
    printf '# on SIGUSR1/SIGTERM/SIGINT: kill -%s <driver pid>; wait for it\n' "${SAO_STOP_SIGNAL:-INT}"
    return 0
  fi
  SAO_DRIVER_PID=$SAO_LAST_PID
  sao_log "driver pid $SAO_DRIVER_PID: $*"
  if [[ -n $SAO_PENDING_SIGNAL ]]; then sao_forward "$SAO_PENDING_SIGNAL"; fi
  while kill -0 "$SAO_DRIVER_PID" 2>/dev/null; do
    wait "$SAO_DRIVER_PID" || true # returns early when a trapped signal arrives
  done
  wait "$SAO_DRIVER_PID" && rc=0 || rc=$?
  trap - USR1 TERM INT
  sao_log "driver exited with status $rc"
  return "$rc"
}

sao_forward() {
  local stop=${SAO_STOP_SIGNAL:-INT}
  if [[ -z $SAO_DRIVER_PID ]]; then
    SAO_PENDING_SIGNAL=$1
    sao_log "received SIG$1 while the driver starts: it gets SIG$stop once it runs"
    return
  fi
  sao_log "received SIG$1: sending SIG$stop to the driver (pid $SAO_DRIVER_PID) to checkpoint and stop"
  kill -s "$stop" "$SAO_DRIVER_PID" 2>/dev/null || true
}
