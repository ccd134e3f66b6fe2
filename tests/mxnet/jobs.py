"""Whole MPI jobs started from a plain pytest run, with this environment's Python and MPI."""

import os
import sys
from pathlib import Path

from ..jobs.conftest import launch

ROOT = Path(__file__).resolve().parents[2]


def run_job(n, script, *args, timeout=180):
    """Runs ``python SCRIPT ARGS`` on ``n`` ranks; asserts it succeeded; returns its output."""
    cmd = ["timeout", "-k", "5", str(timeout), str(ROOT / "scripts" / "mpirun.sh"), "-n", str(n),
           sys.executable, str(script), *args]
    # MPIKV_VENV: the mpiexec of this environment's Open MPI (the one its mpi4py uses).
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_VENV=sys.prefix, MPIKV_TIMEOUT="120",
               MPIKV_AUTOTUNE="0", OMP_NUM_THREADS="1")
    rc, out = launch(cmd, env)
    assert rc == 0, out
    return out
