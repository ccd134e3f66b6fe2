"""Gluon training saved on N ranks resumes on M ranks exactly (whole MPI jobs).

``Trainer.save_states`` at N ranks writes each owner's part of the optimizer
state; a new job of M ranks loads it with ``Trainer.load_states`` (MXNet could
not do this on a dist store: apache/mxnet#15923). The resumed weights equal a
run that never stopped, bit for bit (see scripts/resume.py for why sums are
exact on any number of ranks).
"""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")

from .jobs import run_job as _run  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "resume.py"
STEPS = 6


def run_job(n, *args):
    _run(n, SCRIPT, *args)


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
