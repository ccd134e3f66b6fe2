"""A rank that fails, or never comes, before any store exists ends the job; the
store's creation is under the watchdog (issue 38, class 3)."""

import functools
import importlib.util

import pytest

from .conftest import run_job, started_together

SCRIPT = "tests/jobs/scripts/create_fault.py"
#: the creation's timeout; a hang is caught by run_job's far longer bound
TIMEOUT = 20
ENV = {"MPIKV_TIMEOUT": str(TIMEOUT), "MPIKV_AUTOTUNE": "0"}


def ended(case, env=ENV):
    rc, out, _ = run_job(2, SCRIPT, case, timeout=300, env=env)
    assert rc not in (0, 124), out   # 124: still waiting at the bound
    assert "finished" not in out, out
    return rc, out


@pytest.mark.parametrize("case, error", [
    ("raise_before", "RuntimeError: boom before any store"),
    ("bad_comm", "TypeError: comm must be an mpi4py intra-communicator, not str"),
    # torch's hook wraps mpikv's and holds back what it prints until it returns: the
    # traceback must reach the output before MPI_Abort all the same
    pytest.param("torch_group", "RuntimeError: boom after init_process_group",
                 marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                          reason="needs torch"))])
def test_an_uncaught_exception_before_any_store_ends_the_job(case, error):
    rc, out = ended(case)
    assert rc == 1, out   # the exception hook's MPI_Abort code
    exc = error.split(":", 1)[0]
    assert f"mpikv: uncaught {exc} on rank 1 of 2; aborting the job so no rank waits " \
           "forever" in out, out
    assert f"[rank 1] {error}" in out, out


@pytest.fixture(scope="module")
def timed_out():
    """The two jobs that wait out the creation's timeout, started together."""
    return started_together({
        "stuck": functools.partial(ended, "stuck_before"),
        "no_abort": functools.partial(ended, "raise_before",
                                      env={**ENV, "MPIKV_ABORT_ON_EXCEPTION": "0"})})


def test_a_rank_that_never_comes_ends_the_creation_at_the_timeout(timed_out):
    rc, out = timed_out["stuck"].result()
    assert rc == 3, out   # the watchdog's MPI_Abort code
    assert f"mpikv: rank 0: create did not complete within {TIMEOUT} s (a rank is stuck " \
           "or gone); ending the job. create(timeout=) or MPIKV_TIMEOUT sets the limit." in out
    # The flight recorder names the creation as the call rank 0 is in.
    assert "  rank 0: store 0 call 0: create (no keys), waiting for the other ranks to " \
           "agree for" in out, out


def test_without_abort_on_exception_the_timeout_ends_the_creation(timed_out):
    rc, out = timed_out["no_abort"].result()
    assert rc == 3, out
    assert "RuntimeError: boom before any store" in out, out
    assert "uncaught RuntimeError" not in out, out
    assert f"mpikv: rank 0: create did not complete within {TIMEOUT} s" in out, out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_bad_ddp_argument_on_one_rank_ends_the_job():
    _, out = ended("ddp")
    assert "mpikv: uncaught InputError on rank 1 of 2" in out, out
    assert "[rank 1] mpikv.errors.InputError: DistributedDataParallel takes no " \
           "bogus_argument" in out, out
