"""The CUDA-aware Open MPI of ``scripts/build-cuda-mpi.sh`` (issue 41), where one is
built: ``MPIKV_MPI_PREFIX``, else ``.cuda-mpi`` in the checkout. Skipped otherwise (the
build takes about 40 minutes on 2 cores; ``scripts/build-cuda-mpi.sh .cuda-mpi`` makes one).

A few seconds: ``ompi_info`` says built with CUDA, and a 2-rank job through
``scripts/mpirun.sh`` runs on that library, with the mpi4py built against it, through a
store. Without a GPU the library's runtime answer is "not CUDA-aware" (its CUDA
plug-ins find no driver), so the store stages, which is right.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import MPIRUN, ROOT, launch


def _prefix():
    given = os.environ.get("MPIKV_MPI_PREFIX", "").strip()
    path = Path(given) if given else ROOT / ".cuda-mpi"
    if not (path / "bin" / "mpiexec").exists():
        pytest.skip(f"no CUDA-aware Open MPI at {path} (scripts/build-cuda-mpi.sh .cuda-mpi "
                    "builds one, about 40 minutes on 2 cores; or set MPIKV_MPI_PREFIX)")
    return path.resolve()


def _has_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


def test_ompi_info_says_built_with_cuda():
    prefix = _prefix()
    proc = subprocess.run([str(prefix / "bin" / "ompi_info"), "--parsable", "--all"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OPAL_PREFIX=str(prefix)))
    assert proc.returncode == 0, proc.stderr
    assert "mpi_built_with_cuda_support:value:true" in proc.stdout
    assert "ompi:version:full:5.0." in proc.stdout


JOB = r"""
import sys
import numpy as np
import mpi4py
from mpi4py import MPI
import mpikv
from mpikv.transport import cuda
comm = MPI.COMM_WORLD
kv = mpikv.create("dist_sync", timeout=60)
kv.init("w", np.zeros(1000, np.float32))
g = np.full(1000, comm.rank + 1, np.float32)
kv.pushpull("w", g)
assert (g == comm.size * (comm.size + 1) // 2).all(), g[:4]
decision = cuda.detect()
kv.close()
if comm.rank == 0:
    print("LIBRARY", MPI.Get_library_version().replace("\x00", "").splitlines()[0])
    print("MPI4PY", mpi4py.__file__)
    print("DETECT", decision.aware, decision.source)
    print("SUM OK", comm.size)
"""


def test_a_job_runs_on_it_with_its_mpi4py(tmp_path):
    prefix = _prefix()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPIKV_", "OPAL_"))}
    env.update(MPIKV_MPI_PREFIX=str(prefix), MPIKV_AUTOTUNE="0",
               MPIKV_CACHE_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    rc, out = launch(["timeout", "-k", "5", "120", str(MPIRUN), "-n", "2", sys.executable,
                      "-c", JOB], env)
    assert rc == 0, out
    assert "LIBRARY Open MPI v5.0." in out, out
    assert f"MPI4PY {prefix / 'python'}" in out, out   # not the venv's, built for the wheel
    assert "SUM OK 2" in out, out
    # the library's own runtime answer: CUDA-aware only where its CUDA plug-in loaded
    assert f"DETECT {_has_gpu()} MPIX_Query_cuda_support() (library)" in out, out
