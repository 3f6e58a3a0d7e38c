#!/usr/bin/env bash
# Debian's munge and Slurm daemons (Debian 12: slurm-wlm 22.05, munge 0.5.15), installed when
# missing with one apt-get update; needs root. Run by .ci/slurm.sh and .ci/slurm_multinode.sh, and
# by .ci/run once before it starts both side by side (so their installs never race on apt's lock).
set -euo pipefail
missing=()
command -v munged >/dev/null || missing+=(munge)
command -v slurmctld >/dev/null || missing+=(slurmctld)
command -v slurmd >/dev/null || missing+=(slurmd)
command -v sbatch >/dev/null || missing+=(slurm-client)
if ((${#missing[@]})); then
  printf '[ci/slurm-packages %s] installing %s\n' "$(date +%H:%M:%S)" "${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
