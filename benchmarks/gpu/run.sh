#!/usr/bin/env bash
# The GPU check in one command: install the carried wheels, then `python -m benchmarks.gpu.check`.
#
#   bash benchmarks/gpu/run.sh [--out DIR] [--budget-s 420] [--sections a,b] [--steps 3] [--cpu-smoke]
#
# Prepare here first (this machine, with the venv): `make gpu-wheels` (benchmarks/gpu/carry.py)
# puts megatron-core's wheel and a pinned requirements.txt in benchmarks/gpu/wheels/ (git-ignored;
# carry that path). On the device the repository travels as the working tree, so sao_megatron
# runs from source (PYTHONPATH), not as a wheel.
#
# Environment: PYTHON (default python3, the image's CUDA torch), GPU_CHECK_WHEELS (default
# benchmarks/gpu/wheels), GPU_CHECK_SITE (install target, default /tmp/sao-gpu-check-site).
# Every other argument goes to the check unchanged; bad ones fail before anything is installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-benchmarks/gpu/wheels}"
SITE="${GPU_CHECK_SITE:-/tmp/sao-gpu-check-site}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
        sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        echo
        exec "$PY" -m benchmarks.gpu.check --help
    fi
done

"$PY" -m benchmarks.gpu.check --check-args "$@"

if [[ -f "$WHEELS/requirements.txt" ]]; then
    echo "[gpu-check] installing $(tr '\n' ' ' < "$WHEELS/requirements.txt")into $SITE"
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi

if ! "$PY" benchmarks/gpu/carry.py --check-imports; then
    echo "error: the check's imports are incomplete; run \`make gpu-wheels\` on the preparing machine" \
         "and carry $WHEELS" >&2
    exit 2
fi

export PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu.check "$@"
