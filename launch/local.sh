#!/bin/bash
# SAO on one machine: `sao train` with signal forwarding (SIGTERM, SIGUSR1 or SIGINT to this
# script make the driver checkpoint and stop). Arguments go to `sao train` unchanged ("$@"),
# followed by cluster.ray_address=127.0.0.1:<port> when this script started a Ray head.
#
#   launch/local.sh                                   the tiny CPU default (configs/tiny_cpu.yaml)
#   SAO_RAY_HEAD=1 launch/local.sh configs/x.yaml     first start a Ray head on 127.0.0.1
#
# Environment [default]:
#   SAO_ROOT           repository checkout [this script's parent directory]
#   SAO_VENV           environment whose bin/ has sao and ray [$SAO_ROOT/.venv if present]
#   SAO_TRAIN          the driver command (word-split) [sao train]
#   SAO_STOP_SIGNAL    signal the driver gets on SIGUSR1/SIGTERM/SIGINT [INT]
#   SAO_TRAIN_LOG      driver log file [- : this terminal]
#   SAO_RAY_HEAD=1     start a Ray head (resources sao_actor/sao_critic/sao_rollout, like one
#                      shared Slurm node) and pass its address to the driver as the override
#                      cluster.ray_address [0: the driver starts a private Ray instance itself]
#   SAO_RAY_PORT, SAO_RAY_TMP, SAO_GPUS_PER_NODE, SAO_RAY_ARGS, SAO_LOG_DIR   as in
#                      launch/slurm/sao.sbatch [6379, /tmp/ray-sao-local-<pid>, autodetect, -,
#                      $SAO_ROOT/logs/local]
set -euo pipefail

SAO_ROOT=${SAO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$SAO_ROOT/launch/common.sh"
if [[ -z ${SAO_VENV:-} && -x $SAO_ROOT/.venv/bin/sao ]]; then SAO_VENV=$SAO_ROOT/.venv; fi
if [[ -n ${SAO_VENV:-} ]]; then export PATH="$SAO_VENV/bin:$PATH"; fi
read -r -a train <<<"${SAO_TRAIN:-sao train}"
cluster=() # overrides appended to the driver's arguments

if [[ ${SAO_RAY_HEAD:-0} == 1 ]]; then
  port=${SAO_RAY_PORT:-6379}
  log_dir=${SAO_LOG_DIR:-$SAO_ROOT/logs/local}/$(date +%Y%m%d-%H%M%S)-$$
  read -r -a ray_extra <<<"${SAO_RAY_ARGS:-}"
  gpus=() units=1
  if [[ -n ${SAO_GPUS_PER_NODE:-} ]]; then gpus=(--num-gpus="$SAO_GPUS_PER_NODE"); fi
  if ((${SAO_GPUS_PER_NODE:-0} > 0)); then units=$SAO_GPUS_PER_NODE; fi
  mkdir -p "$log_dir"
  sao_ray_auth "$log_dir" # token authentication unless RAY_AUTH_MODE=disabled
  trap 'rc=$?; sao_stop_pids "${SAO_PIDS[@]}"; exit "$rc"' EXIT
  sao_cmd "$log_dir/ray-head.log" ray start --head --node-ip-address=127.0.0.1 --port="$port" \
    --include-dashboard=false --temp-dir="${SAO_RAY_TMP:-/tmp/ray-sao-local-$$}" --disable-usage-stats \
    --resources="$(sao_ray_resources shared "$units")" "${gpus[@]}" --block "${ray_extra[@]}"
  sao_wait_ray "127.0.0.1:$port" 1 "${SAO_RAY_WAIT_S:-120}" "${SAO_PIDS[@]}"
  cluster+=("cluster.ray_address=127.0.0.1:$port")
  sao_log "Ray head at 127.0.0.1:$port (log $log_dir/ray-head.log)"
fi

sao_run_driver "${SAO_TRAIN_LOG:--}" "${train[@]}" "$@" "${cluster[@]}"
