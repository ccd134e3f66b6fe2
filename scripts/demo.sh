#!/usr/bin/env bash
# Sets everything up (once) and runs the main demo on 4 ranks.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$top/scripts/setup.sh"
cd "$top"
echo "== MXNet's KVStore tutorial, local store"
.venv/bin/python examples/seed_tutorial.py
echo "== the same on dist_sync, 4 ranks (values are sums over the ranks)"
timeout -k 10 120 scripts/mpirun.sh -n 4 .venv/bin/python examples/seed_tutorial.py --type dist_sync
