"""Which path device buffers take, agreed by the ranks of a store (issue 26, item 8).

Run: ``scripts/mpirun.sh -n 2 python -m pytest tests/mpi/test_cuda_paths.py --with-mpi``.
On the CPU stand-in of cupy (``tests/fakecupy.py``).
"""

import logging

import numpy as np
import pytest

from mpikv.store import config
from mpikv.transport import cuda
from mpikv.transport.mpi import MPITransport

from .. import fakecupy
from ..conftest import gpu_required
from .conftest import TEST_TIMEOUT, raises_everywhere

pytestmark = pytest.mark.mpi


@pytest.fixture
def fake_cp(monkeypatch):
    if gpu_required():   # the GPU check: real cupy only, and its MPI is not CUDA-aware
        pytest.skip("runs on the CPU stand-in, not under MPIKV_TEST_GPU=1")
    cp = fakecupy.install(monkeypatch)
    monkeypatch.setattr(cuda, "FALLBACK", cuda.Fallback())
    yield cp
    assert fakecupy.races() == []


@pytest.fixture
def make_transport(comm):
    """``make_transport()``: the transport a store over ``comm`` makes (white-box: the
    paths are the transport's), closed with the test."""
    made = []

    def make():
        made.append(MPITransport(comm, config.resolve(timeout=TEST_TIMEOUT)))
        return made[-1]
    yield make
    for t in made:
        t.close()


def test_pull_only_stages_reductions_and_not_pulls(make_store, make_transport, fake_cp, comm,
                                                   monkeypatch):
    monkeypatch.setenv(cuda.ENV, "pull")
    cp = fake_cp
    kv = make_store("dist_sync_device")
    t = make_transport()
    assert t.cuda.paths == {"reduce": "staged", "pull": "direct"}
    assert t.staging.direct is False and t.pull_staging.direct is True
    assert t.staging.stager is t.pull_staging.stager   # one pool of host buffers
    facts = t.describe()
    assert facts["cuda_paths"] == {"reduce": "staged", "pull": "direct"}
    n, r = comm.size, comm.rank
    said = kv.describe()   # the store's own transport says the same
    assert (said["rank"], said["size"], said["cuda_paths"]) == (r, n, facts["cuda_paths"])
    assert said["mpi_library"] == facts["mpi_library"]
    kv.init("w", cp.full(6, 7, cp.float32))
    kv.broadcast("b", cp.full(5, r + 3, cp.float32), out=cp.empty(5, cp.float32))
    out = cp.empty(6, cp.float32)
    kv.pushpull("w", cp.full(6, r + 1, cp.float32), out=out)
    np.testing.assert_array_equal(out.get(), np.full(6, n * (n + 1) // 2, np.float32))
    got = cp.empty(5, cp.float32)
    kv.pull("b", out=got)
    np.testing.assert_array_equal(got.get(), np.full(5, 3, np.float32))
    kv.close()


@pytest.mark.parametrize("value,paths", [("1", ("direct", "direct")),
                                         ("0", ("staged", "staged"))])
def test_same_setting_everywhere_is_kept(make_transport, comm, monkeypatch, value, paths):
    monkeypatch.setenv(cuda.ENV, value)
    t = make_transport()
    assert t.cuda.paths == dict(zip(("reduce", "pull"), paths))
    assert t.cuda.source == f"MPIKV_CUDA_AWARE={value}"


def test_ranks_that_differ_all_stage(make_transport, comm, monkeypatch, caplog):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.setenv(cuda.ENV, "1" if comm.rank == 0 else "pull")
    monkeypatch.setattr(cuda, "_disagreement_logged", [])
    with caplog.at_level(logging.WARNING, logger="mpikv.gpu"):
        made = [make_transport(), make_transport()]
    for t in made:
        d = t.cuda
        # pulls: direct everywhere; reductions: staged on rank 1, so staged everywhere
        assert d.paths == {"reduce": "staged", "pull": "direct"}
        assert d.source.startswith("agreed: staged where any rank stages")
    warnings = [r for r in caplog.records if "differ" in r.getMessage()]
    assert len(warnings) == 1   # once per process, not per store


def test_bad_override_on_one_rank_fails_every_rank(make_store, comm, monkeypatch):
    monkeypatch.setenv(cuda.ENV, "maybe" if comm.rank == 0 else "1")
    msg = raises_everywhere(comm, ValueError,
                            lambda: make_store())
    assert "MPIKV_CUDA_AWARE" in msg
