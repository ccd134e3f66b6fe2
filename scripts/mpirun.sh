#!/usr/bin/env bash
# mpiexec with the environment this project needs; arguments pass through.
# Usage: scripts/mpirun.sh -n 4 python examples/seed_tutorial.py
#        scripts/mpirun.sh --ft -n 4 python train.py   # fault tolerant (ULFM)
#
# A thin call of `mpikv run [--ft] --mpiexec ARGS` (mpikv/launch/, docs/launching.md),
# run from this checkout: what the machine needs (root, oversubscription, Open MPI's
# settings, ULFM and the failure detector for --ft: MPIKV_FT_DETECTOR_TIMEOUT,
# MPIKV_FT_DETECTOR_PERIOD), a SIGTERM passed to the ranks with MPIKV_TERM_GRACE seconds
# (default 120) to save, MPIKV_MPI_PREFIX (an Open MPI of scripts/build-cuda-mpi.sh).
# The ranks run in the venv (MPIKV_VENV, default .venv): its bin/ comes first on PATH.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPIKV_VENV:-$top/.venv}
[ -d "$venv/bin" ] && export PATH="$venv/bin:$PATH"
python=$(command -v python3 || command -v python)
ft=()
if [ "${1:-}" = --ft ]; then
  shift
  ft=(--ft)
fi
# The launcher from this checkout (first on its own sys.path only: the ranks' PYTHONPATH
# stays as it was), whether or not the venv has mpikv installed.
exec "$python" -c 'import sys
sys.path.insert(0, sys.argv.pop(1))
from mpikv.launch import main
sys.exit(main(sys.argv[1:]))' "$top" "${ft[@]}" --mpiexec "$@"
