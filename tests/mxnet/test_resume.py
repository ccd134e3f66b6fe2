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


#: (optimizer, embedding kind, ranks before, ranks after): lazy Adam on a row_sparse
#: weight (a row_sparse gradient makes the same row table)
SPARSE = [("adam", "weight", 3, 2)]


@pytest.mark.parametrize("opt,sparse,before,after", SPARSE,
                         ids=[f"{o}-{s}-{b}-{a}" for o, s, b, a in SPARSE])
def test_sparse_trainer_resumes_on_another_number_of_ranks(tmp_path, opt, sparse, before,
                                                           after):
    """A row table's rows and its optimizer's rows, saved by their owners on N ranks,
    resumed on M: the weights of a run that never stopped, bit for bit."""
    full, prefix, out = (str(tmp_path / name) for name in ("full.npz", "ckpt", "w.npz"))
    args = ("--optimizer", opt, "--sparse", sparse)
    run_job(1, "0", str(STEPS), *args, "--out", full)
    run_job(before, "0", "3", *args, "--save", prefix)
    run_job(after, "3", str(STEPS), *args, "--load", prefix, "--out", out)
    got, want = _weights(out), _weights(full)
    assert len(got) == len(want) == 4       # the table, the Dense layer's two, the rate
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
