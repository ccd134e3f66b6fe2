#!/usr/bin/env bash
# mpiexec with the environment this project needs; arguments pass through.
# Usage: scripts/mpirun.sh -n 4 python examples/seed_tutorial.py
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=env.sh
. "$top/scripts/env.sh"
venv=${MPIKV_VENV:-$top/.venv}
[ -d "$venv/bin" ] && export PATH="$venv/bin:$PATH"
exec mpiexec "$@"
