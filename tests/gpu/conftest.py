"""Tests that only a GPU can run (issue 26): real cupy on a real device.

Without cupy or a GPU every test here is skipped ("no GPU"); with
``MPIKV_TEST_GPU=1`` (``scripts/gpu-check.sh``) such a skip fails instead
(``tests/conftest.py``). ``scripts/gpu-check.sh`` runs them:

    python -m pytest tests/gpu/test_bf16_casts.py
    scripts/mpirun.sh -n 2 python -m pytest tests/gpu/test_stream_race.py --with-mpi
"""

import pytest

from mpikv.arrays import backends


@pytest.fixture
def cp():
    """Real cupy, on GPU ``rank % device_count``; skipped without a GPU."""
    if not backends.cupy_available():
        pytest.skip("no GPU (cupy that sees a device)")
    import cupy
    if getattr(cupy, "STAND_IN", False):
        pytest.skip("no GPU: cupy is the CPU stand-in")
    rank = 0
    try:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    except Exception:  # no MPI: one process
        pass
    with cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()):
        yield cupy
