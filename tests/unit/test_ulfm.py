"""Whether a store may be fault tolerant (ULFM), decided the same on every rank.

The job tests (tests/jobs/test_rank_lost.py) launch real ULFM jobs; these check
the decisions on their inputs, with no launcher (mpi4py's singleton).
"""

import pytest

import mpikv
from mpikv import config
from mpikv.transport import ulfm

LAUNCH = ["prterun", "--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "-n", "3",
          "python", "train.py"]


def test_launch_needs_the_library_switch():
    why = ulfm.launch_support(environ={}, parent_argv=LAUNCH)
    assert why.startswith("the launch has no ULFM (OMPI_MCA_mpi_ft_enable is not set)")
    why = ulfm.launch_support(environ={"OMPI_MCA_mpi_ft_enable": "0"}, parent_argv=LAUNCH)
    assert why.startswith("the launch has no ULFM")


@pytest.mark.parametrize("flag", ["1", "true", "TRUE", " yes "])
def test_ulfm_launch_is_accepted(flag):
    assert ulfm.launch_support(environ={"OMPI_MCA_mpi_ft_enable": flag},
                               parent_argv=LAUNCH) is None


@pytest.mark.parametrize("argv", [
    ["/opt/venv/bin/prterun", "-n", "2", "python", "x.py"],
    ["mpiexec", "--mca", "mpi_ft_enable", "1", "-n", "2", "python", "x.py"],
])
def test_plain_launcher_is_refused_even_with_the_switch(argv):
    why = ulfm.launch_support(environ={"OMPI_MCA_mpi_ft_enable": "1"}, parent_argv=argv)
    assert why == (f"the launcher ({argv[0].rsplit('/', 1)[-1]}) was started without "
                   f"--with-ft ulfm: it would end the whole job when a rank dies; launch "
                   f"with scripts/mpirun.sh --ft")


@pytest.mark.parametrize("argv", [
    ["prterun", "--enable-recovery", "-n", "2", "python", "x.py"],
    ["prted", "--prtemca", "ess", "env"],        # a remote host's daemon: the switch decides
    ["bash", "job.sh"],
])
def test_recovering_or_unknown_parents_go_by_the_switch(argv):
    assert ulfm.launch_support(environ={"OMPI_MCA_mpi_ft_enable": "1"}, parent_argv=argv) is None


class _Ranks:
    """A communicator stand-in whose allgather gives this rank's record and the others'."""

    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine, *self.others]


def test_every_rank_gets_the_same_refusal(monkeypatch):
    monkeypatch.setattr(ulfm, "library_support", lambda: None)
    monkeypatch.setattr(ulfm, "launch_support", lambda: "no launch here")
    with pytest.raises(mpikv.FaultToleranceUnavailableError) as info:
        ulfm.agree_on_support(_Ranks([(True, "no launch here"), (True, None)]), True)
    assert str(info.value) == ("create(fault_tolerant=True): ranks 0, 1: no launch here; "
                               "no store was created")


def test_ranks_that_ask_differently_get_a_mismatch():
    with pytest.raises(mpikv.MismatchError) as info:
        ulfm.agree_on_support(_Ranks([(True, None), (False, None)]), False)
    assert str(info.value) == ("create: fault_tolerant=True on rank 1 but not on ranks 0, 2; "
                               "no store was created")
    assert ulfm.agree_on_support(_Ranks([(False, None)]), False) is False


def test_failure_classes():
    from mpi4py import MPI
    assert ulfm.is_failure(MPI.Exception(MPI.ERR_PROC_FAILED))
    assert ulfm.is_failure(MPI.Exception(MPI.ERR_REVOKED))
    assert not ulfm.is_failure(MPI.Exception(MPI.ERR_TRUNCATE))
    assert not ulfm.is_failure(RuntimeError("x"))


def test_this_library_has_ulfm():
    from mpi4py import MPI
    if "Open MPI" not in MPI.Get_library_version():
        pytest.skip("not Open MPI")
    assert ulfm.library_support() is None


def test_option_from_keyword_environment_and_create():
    assert config.resolve(environ={}).fault_tolerant is False
    assert config.resolve(environ={"MPIKV_FAULT_TOLERANT": "1"}).fault_tolerant is True
    assert config.resolve(environ={"MPIKV_FAULT_TOLERANT": "1"},
                          fault_tolerant=False).fault_tolerant is False
    with config.requested(True):
        assert config.resolve(environ={}).fault_tolerant is True
    assert config.resolve(environ={}).fault_tolerant is False
    with pytest.raises(ValueError, match="fault_tolerant"):
        config.resolve(environ={"MPIKV_FAULT_TOLERANT": "maybe"})


def test_create_refuses_a_singleton_and_a_local_store_ignores_it(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    with pytest.raises(mpikv.FaultToleranceUnavailableError,
                       match=r"rank 0: the launch has no ULFM .* no store was created"):
        mpikv.create("dist_sync", fault_tolerant=True, autotune=False)
    with mpikv.create("local", fault_tolerant=True) as kv:
        assert kv.num_workers == 1
    with mpikv.create("dist_sync", fault_tolerant=False, autotune=False) as kv:
        assert kv._transport.fault_tolerant is False
