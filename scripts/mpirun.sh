#!/usr/bin/env bash
# mpiexec with the environment this project needs; arguments pass through.
# Usage: scripts/mpirun.sh -n 4 python examples/seed_tutorial.py
#        scripts/mpirun.sh --ft -n 4 python train.py   # fault tolerant (ULFM), see below
#
# --ft (only as the first argument) launches with ULFM (--with-ft ulfm: the
# launcher no longer ends the job when a rank dies, and Open MPI reports the
# loss as MPI_ERR_PROC_FAILED) and the failure detector on, which shared
# memory needs to notice a dead peer at all (docs/fault-tolerance.md):
# MPIKV_FT_DETECTOR_TIMEOUT and MPIKV_FT_DETECTOR_PERIOD set the detector (see
# scripts/env.sh, which makes the options).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
. "$top/scripts/env.sh"
venv=${MPIKV_VENV:-$top/.venv}
[ -d "$venv/bin" ] && export PATH="$venv/bin:$PATH"
if [ "${1:-}" = --ft ]; then
  shift
  exec mpiexec "${ft_args[@]}" "$@"
fi
exec mpiexec "$@"
