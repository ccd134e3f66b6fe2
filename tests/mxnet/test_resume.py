"""Gluon training saved on N ranks resumes on M ranks exactly (whole MPI jobs).

``Trainer.save_states`` at N ranks writes each owner's part of the optimizer
state; a new job of M ranks loads it with ``Trainer.load_states`` (MXNet could
not do this on a dist store: apache/mxnet#15923). The resumed weights equal a
run that never stopped, bit for bit (see scripts/resume.py for why sums are
exact on any number of ranks).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).parent / "scripts" / "resume.py")
STEPS = 6


def run_job(n, *args, timeout=180):
    """Runs ``resume.py ARGS`` on ``n`` ranks with this environment's Python and MPI."""
    cmd = ["timeout", "-k", "5", str(timeout), str(ROOT / "scripts" / "mpirun.sh"), "-n", str(n),
           sys.executable, SCRIPT, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_VENV=sys.prefix, MPIKV_TIMEOUT="120",
               MPIKV_AUTOTUNE="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    out = (proc.stdout + proc.stderr).replace("\x00", "")
    assert proc.returncode == 0, out


def _weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    found = {}
    for opt in ("sgd", "adam"):
        out = tmp_path_factory.mktemp("full") / f"{opt}.npz"
        run_job(2, "0", str(STEPS), "--optimizer", opt, "--out", str(out))
        found[opt] = _weights(out)
    return found


@pytest.mark.parametrize("opt,before,after", [("sgd", 2, 3), ("sgd", 4, 1), ("adam", 3, 2),
                                              ("adam", 1, 4)])
def test_resume_on_another_number_of_ranks(tmp_path, uninterrupted, opt, before, after):
    prefix, out = str(tmp_path / "ckpt"), str(tmp_path / "w.npz")
    run_job(before, "0", "3", "--optimizer", opt, "--save", prefix)
    run_job(after, "3", str(STEPS), "--optimizer", opt, "--load", prefix, "--out", out)
    got, want = _weights(out), uninterrupted[opt]
    assert len(got) == len(want) == 5       # four parameters and the final rate
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
