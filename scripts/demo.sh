#!/usr/bin/env bash
# Sets everything up (once) and runs the main demo: data-parallel training of a small
# network on scikit-learn's digits over 2 MPI ranks, with the optimizer on the owners.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$top/scripts/setup.sh"
cd "$top"
echo "== training on 2 ranks (scripts/mpirun.sh -n 2 python examples/train_digits.py)"
timeout -k 10 300 scripts/mpirun.sh -n 2 .venv/bin/python examples/train_digits.py
echo "== MXNet's KVStore tutorial on dist_sync, 4 ranks (values are sums over the ranks)"
timeout -k 10 120 scripts/mpirun.sh -n 4 .venv/bin/python examples/seed_tutorial.py --type dist_sync
