#!/usr/bin/env bash
# The GPU check of issue 26: everything that only a GPU can test, in the order of
# ../shared/notes/gpu_recipe.md's "first ten minutes", on a machine with a GPU and no
# network, within 9 minutes. Each step runs under `timeout`, writes its own log, and
# one line of the summary (step, rc, seconds, note). A global deadline skips the
# steps left ("skipped: out of time").
#
# Usage:  scripts/gpu-check.sh [OUT_DIR] [--dry]
#   OUT_DIR  where the logs and summary.tsv go (default: $OUT, else results/gpu-check)
#   --dry    run no step: each log gets the command it would run (MPIKV_GPU_CHECK_DRY=1)
# Environment:
#   MPIKV_GPU_CHECK_BUDGET  seconds for the whole check (default 540: 9 minutes)
#   MPIKV_PYTHON            the Python (default: python3; .venv/bin/python where there
#                           are no wheels in .whl/ and a .venv exists)
#   MPIKV_GPU_WHEELS_DIR    the wheels (default .whl/); MPIKV_GPU_SITE: where they go
#                           (default /tmp/site)
#   MPIKV_MPI_PREFIX        a CUDA-aware Open MPI (scripts/build-cuda-mpi.sh; default
#                           .cuda-mpi in the checkout, when there): every step runs on
#                           it, and the direct steps run too (issue 41)
#
# With the CUDA-aware Open MPI (built on a CPU machine and carried in beside .whl/:
# docs/gpu.md, "A CUDA-aware Open MPI"), the steps that say MPIKV_CUDA_AWARE=0 are the
# staged path on that same library, and the *-direct steps (MPIKV_CUDA_AWARE unset: the
# store's detection decides, and must say CUDA-aware: MPIKV_EXPECT_CUDA_AWARE=1) run
# beside them in the same run. Without it the direct steps are "skipped: no CUDA-aware
# MPI" and the rest runs on the pip wheel, staged, as before.
#
# The wheels the GPU machine lacks (Open MPI, pytest-mpi, a matching mpi4py) come beside
# the checkout in .whl/ (scripts/fetch-gpu-wheels.sh fetches them on a machine with a
# network); they are installed offline with pip install --prefix /tmp/site (not --target,
# which loses Open MPI's libraries), PATH, PYTHONPATH and LD_LIBRARY_PATH pointing there.
# mpikv itself runs from the checkout (PYTHONPATH). Tests run with MPIKV_TEST_GPU=1 (tests/conftest.py): real cupy
# only, the stand-in's cases deselected, a skip for want of a GPU is a failure.
# On a machine without a GPU the probe runs and the GPU steps are "skipped: no GPU".
# Exit status: 0 when no step failed (skipped steps do not fail the check), else 1.
set -u -o pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"

out=${OUT:-}
dry=${MPIKV_GPU_CHECK_DRY:-0}
for arg in "$@"; do
  case $arg in
    --dry) dry=1 ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) out=$arg ;;
  esac
done
out=${out:-$top/results/gpu-check}
mkdir -p "$out"
budget=${MPIKV_GPU_CHECK_BUDGET:-540}
start=$(date +%s)
summary=$out/summary.tsv
printf 'step\trc\tseconds\tnote\n' > "$summary"
failed=0
n=0

# -- the environment: wheels from .whl/, the checkout on PYTHONPATH, Open MPI's settings --
export PYTHONUNBUFFERED=1
py=${MPIKV_PYTHON:-}
whl=${MPIKV_GPU_WHEELS_DIR:-$top/.whl}
if compgen -G "$whl/*.whl" > /dev/null; then
  py=${py:-python3}
  site=${MPIKV_GPU_SITE:-/tmp/site}
  # --prefix, not --target: --target drops the wheel's data files under lib/, which are
  # Open MPI's libraries (libmpi, libprrte), so mpiexec and mpi4py would not start.
  # -I: the machine's own mpi4py must not count as "already installed".
  if [ "$dry" != 1 ]; then
    "$py" -m pip install -q -I --no-index --no-deps --no-compile --prefix "$site" "$whl"/*.whl \
      > "$out/00-wheels.log" 2>&1 || echo "pip install of $whl failed: see 00-wheels.log" >&2
  fi
  # Where pip put them depends on the interpreter's scheme (Debian's: $site/local/...).
  found() { find "$site" "$@" -print 2>/dev/null | head -1; }
  pkgs=$(found -type d -path '*-packages/mpi4py')
  libmpi=$(found -name 'libmpi.so*')
  mpiexec=$(found -name mpiexec)
  pkgs=${pkgs:+$(dirname "$pkgs")}
  prefix=$(dirname "$(dirname "${mpiexec:-$site/bin/mpiexec}")")
  export PYTHONPATH="${pkgs:+$pkgs:}$top${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH"
  export LD_LIBRARY_PATH="$(dirname "${libmpi:-$site/lib/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export MPIKV_VENV=$prefix      # scripts/mpirun.sh puts $MPIKV_VENV/bin on PATH
else
  if [ -z "$py" ] && [ -x "$top/.venv/bin/python" ]; then py=$top/.venv/bin/python; fi
  py=${py:-python3}
  export PYTHONPATH="$top${PYTHONPATH:+:$PYTHONPATH}"
fi
# -- a CUDA-aware Open MPI, when carried in: first on every path, ahead of the wheels --
cuda_mpi=${MPIKV_MPI_PREFIX:-}
if [ -z "$cuda_mpi" ] && [ -x "$top/.cuda-mpi/bin/mpiexec" ]; then cuda_mpi=$top/.cuda-mpi; fi
if [ -n "$cuda_mpi" ] && [ ! -x "$cuda_mpi/bin/mpiexec" ]; then
  echo "gpu-check: MPIKV_MPI_PREFIX=$cuda_mpi has no bin/mpiexec; not used" >&2
  cuda_mpi=
fi
if [ -n "$cuda_mpi" ]; then
  cuda_mpi=$(cd "$cuda_mpi" && pwd)
  # The probe and the one-process steps run outside scripts/mpirun.sh, which sets the
  # same for jobs (MPIKV_MPI_PREFIX): its mpi4py, libraries and ompi_info come first.
  export MPIKV_MPI_PREFIX=$cuda_mpi OPAL_PREFIX=$cuda_mpi PATH="$cuda_mpi/bin:$PATH"
  export PYTHONPATH="$cuda_mpi/python:$PYTHONPATH"
  export LD_LIBRARY_PATH="$cuda_mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  unset MPIKV_MPI_PREFIX
fi
# shellcheck source=env.sh
. "$top/scripts/env.sh"
export MPIKV_TEST_GPU=1
mpirun=("$top/scripts/mpirun.sh")
pytest=("$py" -m pytest -q -p no:randomly)

gpu=0
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then gpu=1; fi

record() {  # step rc seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$summary"
  printf '%-22s rc=%-4s %5ss  %s\n' "$1" "$2" "$3" "$4"
}

# step NAME LIMIT NEEDS COMMAND: runs COMMAND (a bash string) under timeout, at most
# LIMIT seconds and never past the global deadline. NEEDS: 0 nothing, 1 a GPU, 2 a GPU
# and the CUDA-aware Open MPI.
step() {
  local name=$1 limit=$2 needs_gpu=$3 cmd=$4
  n=$((n + 1))
  local log
  log=$out/$(printf '%02d' "$n")-$name.log
  local left=$((start + budget - $(date +%s)))
  if [ "$dry" = 1 ]; then
    printf 'dry run; would run (limit %ss):\n%s\n' "$limit" "$cmd" > "$log"
    record "$name" - 0 "dry"
    return
  fi
  if [ "$left" -lt 25 ]; then
    echo "skipped: out of time" > "$log"
    record "$name" - 0 "skipped: out of time"
    return
  fi
  if [ "$needs_gpu" -ge 1 ] && [ "$gpu" != 1 ]; then
    echo "skipped: no GPU (nvidia-smi -L failed)" > "$log"
    record "$name" - 0 "skipped: no GPU"
    return
  fi
  if [ "$needs_gpu" = 2 ] && [ -z "$cuda_mpi" ]; then
    echo "skipped: no CUDA-aware MPI (no MPIKV_MPI_PREFIX, no .cuda-mpi: scripts/build-cuda-mpi.sh .cuda-mpi)" > "$log"
    record "$name" - 0 "skipped: no CUDA-aware MPI"
    return
  fi
  [ "$limit" -gt $((left - 15)) ] && limit=$((left - 15))   # and -k 10: ends by the deadline
  local t0 rc note
  t0=$(date +%s)
  printf '$ %s\n' "$cmd" > "$log"
  timeout -k 10 "$limit" bash -c "$cmd" >> "$log" 2>&1
  rc=$?
  note=$(grep -a -E '[0-9]+ (passed|failed|error)' "$log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g')
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note="timed out after ${limit}s${note:+; $note}"; fi
  [ "$rc" = 0 ] || failed=1
  [ -n "$note" ] || { [ "$rc" = 0 ] && note=ok || note=failed; }
  record "$name" "$rc" $(($(date +%s) - t0)) "$note"
}

echo "gpu-check: logs and summary in $out (budget ${budget}s, python $py, gpu=$gpu, dry=$dry, cuda-aware MPI: ${cuda_mpi:-none})"

# 0. what is there
step probe 60 0 "
nvidia-smi -L || echo 'no nvidia-smi / no GPU'
$py - <<'PY'
import importlib, platform
print('python', platform.python_version(), platform.machine())
for name in ('numpy', 'cupy', 'torch', 'mpi4py', 'ml_dtypes', 'pytest', 'pytest_mpi', 'hypothesis'):
    try:
        mod = importlib.import_module(name)
        print(f'{name:10s}', getattr(mod, '__version__', '?'), getattr(mod, '__file__', ''))
    except Exception as exc:
        print(f'{name:10s} missing: {type(exc).__name__}: {exc}')
try:
    import torch
    print('torch cuda', torch.version.cuda, 'available', torch.cuda.is_available(),
          torch.cuda.device_count())
except Exception as exc:
    print('torch cuda: ', exc)
try:
    import cupy
    print('cupy devices', cupy.cuda.runtime.getDeviceCount(), 'runtime', cupy.cuda.runtime.runtimeGetVersion())
except Exception as exc:
    print('cupy cuda: ', exc)
from mpi4py import MPI
print(MPI.Get_library_version().strip())
from mpikv.transport import cuda
print('detect():', cuda.detect())
PY
command -v ompi_info > /dev/null && ompi_info --parsable --all | grep built_with_cuda_support:value
echo 'MPIKV_MPI_PREFIX=${cuda_mpi:-}'
ldd --version 2>&1 | head -1   # the CUDA-aware build needs glibc 2.36 or later (libevent's arc4random)
$py -m mpikv info
"

# 1. unit tests that touch real cupy and CUDA torch (DLPack, bfloat16 views, copies, detection)
step unit-real-cupy 120 1 "${pytest[*]} tests/unit/test_backends.py tests/unit/test_cuda_detect.py"

# 2. the store on real cupy, staged, 2 ranks sharing the GPU
step store-staged-2 150 1 "MPIKV_CUDA_AWARE=0 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi tests/mpi/test_gpu.py tests/mpi/test_gpu_bfloat16.py"

# 2b. the same with the CUDA-aware Open MPI, direct: the detection must say CUDA-aware
#     (tests/gpu/test_cuda_aware_mpi.py: raw device collectives, the store's direct path,
#     one staging rank makes all stage), then the store's GPU tests on the direct path
direct="MPIKV_EXPECT_CUDA_AWARE=1 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi"
step store-direct-2 180 2 "$direct tests/gpu/test_cuda_aware_mpi.py; a=\$?; $direct tests/mpi/test_gpu.py tests/mpi/test_gpu_bfloat16.py; b=\$?; exit \$((a ? a : b))"

# 3. the torch Trainer on CUDA at 2 ranks (16-bit, allreduce_grads + update, join)
trainer="MPIKV_CUDA_AWARE=0 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi"
if [ -f tests/mpi/test_trainer_device.py ]; then
  step trainer-cuda-2 150 1 "$trainer tests/mpi/test_trainer_device.py; a=\$?; $trainer tests/mpi/test_trainer.py -k cuda; b=\$?; exit \$((a ? a : b))"
else
  step trainer-cuda-2 150 1 "$trainer tests/mpi/test_trainer.py -k cuda"
fi

# 3b. the Trainer on CUDA at 2 ranks, direct (the CUDA-aware Open MPI)
if [ -f tests/mpi/test_trainer_device.py ]; then
  step trainer-direct-2 150 2 "MPIKV_EXPECT_CUDA_AWARE=1 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi tests/mpi/test_trainer_device.py"
fi

# 3c. the "mpikv" torch.distributed backend on CUDA tensors at 2 ranks, direct (staged:
#     in mpi-device-rest)
step backend-direct-2 120 2 "MPIKV_EXPECT_CUDA_AWARE=1 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi tests/mpi/test_process_group.py -k 'cuda and not stand-in'"

# 4. the stream-race stress: 256 MiB, 50 queued kernels before each pushpull(_async)
step stream-race-2 150 1 "MPIKV_CUDA_AWARE=0 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi tests/gpu/test_stream_race.py"

# 5. bfloat16 casts on the GPU against ml_dtypes, bit for bit
step bf16-casts 90 1 "${pytest[*]} tests/gpu/test_bf16_casts.py"

# 6. bench gpu (ResNet-50's gradients): the store staged against raw mpi4py staged;
#    at 1 rank NCCL as well (NCCL needs a GPU per rank)
step bench-gpu-2 120 1 "MPIKV_CUDA_AWARE=0 ${mpirun[*]} -n 2 $py -m mpikv bench gpu --workload resnet50 --iterations 10"
step bench-gpu-1 60 1 "MPIKV_CUDA_AWARE=0 ${mpirun[*]} -n 1 $py -m mpikv bench gpu --workload resnet50 --iterations 10"
# 6b. the same direct (the detection decides: raw mpi4py on the device buffers too), and
#     direct with only the smcuda BTL (CUDA IPC between the two ranks) for shared memory
step bench-gpu-direct-2 120 2 "${mpirun[*]} -n 2 $py -m mpikv bench gpu --workload resnet50 --iterations 10"
step bench-gpu-smcuda-2 120 2 "OMPI_MCA_btl=smcuda,self ${mpirun[*]} -n 2 $py -m mpikv bench gpu --workload resnet50 --iterations 10"

# 7. the rest of tests/mpi, device cases only
step mpi-device-rest 180 1 "MPIKV_CUDA_AWARE=0 ${mpirun[*]} -n 2 ${pytest[*]} --with-mpi tests/mpi -k 'cupy or cuda or gpu or device' --ignore=tests/mpi/test_gpu.py --ignore=tests/mpi/test_gpu_bfloat16.py --ignore=tests/mpi/test_trainer_device.py --ignore=tests/mpi/test_calls_property.py"

total=$(($(date +%s) - start))
record total "$failed" "$total" "$( [ "$failed" = 0 ] && echo 'no step failed' || echo 'a step failed')"
exit "$failed"
