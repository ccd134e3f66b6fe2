"""Whether a store may be fault tolerant (ULFM), decided the same on every rank.

The job tests (tests/jobs/test_rank_lost.py) launch real ULFM jobs; these check
the decisions on their inputs, with no launcher (mpi4py's singleton).
"""

import pytest

import mpikv
from mpikv.store import config
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
    # A plain keyword of the store's create (no thread-local hand-over left).
    import inspect
    from mpikv.store import factory
    assert "fault_tolerant" in inspect.signature(factory.create).parameters
    assert not hasattr(config, "requested")
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
        assert kv.fault_tolerant is False


class _Group:
    def __init__(self, ranks):
        self.ranks = ranks

    def Translate_ranks(self, ranks, other):
        from mpi4py import MPI
        return [other.ranks.index(self.ranks[r]) if self.ranks[r] in other.ranks
                else MPI.UNDEFINED for r in ranks]

    def Get_size(self):
        return len(self.ranks)

    def Free(self):
        pass


class _Comm:
    """A communicator stand-in: ``ranks`` (process ids) in order, this one's index,
    and what the survivors' allgather gives the others."""

    def __init__(self, ranks, me, others=None):
        self.ranks, self.me, self.others, self.revoked = ranks, me, others, False

    def Get_size(self):
        return len(self.ranks)

    def Get_rank(self):
        return self.me

    def Get_group(self):
        return _Group(self.ranks)

    def Revoke(self):
        self.revoked = True

    def Set_errhandler(self, handler):
        pass

    def Shrink(self):
        alive = [p for p in self.ranks if p in self.others]
        return _Comm(alive, alive.index(self.ranks[self.me]), self.others)

    def allgather(self, mine):
        return [mine if p == self.ranks[self.me] else self.others[p] for p in self.ranks]

    def Ibarrier(self):
        # ``others``: the survivors that reach their end; the rest were lost meanwhile
        from mpi4py import MPI
        if self.others is None or set(self.others) >= set(self.ranks):
            return _Request(self.others is not None)
        raise MPI.Exception(MPI.ERR_PROC_FAILED)

    def Get_failed(self):
        return _Group([p for p in self.ranks if p not in self.others])


class _Request:
    def __init__(self, arrives):
        self.arrives = arrives

    def Test(self):
        return self.arrives


def _recovery(monkeypatch, me, others):
    monkeypatch.setattr(ulfm, "_SURVIVORS", {})
    monkeypatch.setattr(ulfm, "_register_end", lambda: None)
    old = _Comm([10, 11, 12], me, others)
    extra = _Comm([10, 11, 12], me)
    calls = {10: 12, 11: None, 12: 12}
    recovery = ulfm.Recovery(lambda: [old, extra], old, lambda r: r + 5, 60.0,
                             lambda what: f"{what[0]} (key {what[1][0]!r})",
                             lambda: calls[old.ranks[me]])
    return recovery, old, extra


def test_a_failure_is_one_agreed_error(monkeypatch):
    from mpi4py import MPI
    others = {10: (12, "pushpull (key 'w')"), 12: (12, "pushpull (key 'w')")}
    recovery, old, extra = _recovery(monkeypatch, 0, others)
    assert recovery.check(ValueError("not MPI"), ("pushpull", ["w"])) is None
    assert recovery.check(MPI.Exception(MPI.ERR_TRUNCATE), ("pushpull", ["w"])) is None
    with pytest.raises(mpikv.RankLostError) as info:
        recovery.check(MPI.Exception(MPI.ERR_PROC_FAILED), ("pushpull", ["w"]))
    exc = info.value
    assert old.revoked and extra.revoked
    assert str(exc) == ("rank 1 of 3 lost (COMM_WORLD rank 6) during pushpull (key 'w'): the "
                        "process died; 2 survive (0, 2). This store is unusable now; a store "
                        "made on the survivors' communicator (this error's .comm) goes on")
    assert (exc.lost, exc.lost_world, exc.survivors, exc.call) == ([1], [6], [0, 2], 12)
    assert exc.completed_on == [] and exc.completed_here is False
    assert exc.comm.Get_size() == 2
    # Later calls: the same error again, no second recovery.
    with pytest.raises(mpikv.RankLostError) as again:
        recovery.check(MPI.Exception(MPI.ERR_REVOKED), ("barrier", []))
    assert str(again.value) == str(exc)


@pytest.mark.parametrize("me", [0, 2])
def test_survivors_a_call_apart_are_told_which_completed(monkeypatch, me):
    from mpi4py import MPI
    # Rank 0 got the dead rank's data of call 12 and met the loss entering call 13
    # (a barrier); rank 2 was still in call 12.
    others = {10: (13, "barrier"), 12: (12, "pushpull (key 'w')")}
    recovery, _, _ = _recovery(monkeypatch, me, others)
    recovery._calls = lambda: others[10 + me][0]
    with pytest.raises(mpikv.RankLostError) as info:
        recovery.check(MPI.Exception(MPI.ERR_REVOKED), ("barrier" if me == 0 else "pushpull",
                                                         ["w"]))
    exc = info.value
    assert str(exc) == ("rank 1 of 3 lost (COMM_WORLD rank 6) during pushpull (key 'w'): the "
                        "process died; 2 survive (0, 2); that call completed on rank 0 but not "
                        "on rank 2: what it gave there is not the others' "
                        "(RankLostError.completed_on). This store is unusable now; a store "
                        "made on the survivors' communicator (this error's .comm) goes on")
    assert exc.call == 12 and exc.completed_on == [0]
    assert exc.completed_here is (me == 0)


def test_survivors_that_all_reach_their_end_end_together():
    survivors = _Comm([10, 12], 0, others={10: None, 12: None})
    assert ulfm.wait_for_survivors(survivors, 60.0) is None


def test_a_survivor_lost_before_the_end_is_named_in_the_world():
    # 11 died earlier; of the survivors 10 and 12, 12 stopped sending heartbeats.
    survivors = _Comm([10, 12], 0, others={10: None})
    world = _Comm([10, 11, 12], 0)
    from mpi4py import MPI
    assert ulfm.wait_for_survivors(survivors, 60.0, world) == (
        f"COMM_WORLD rank 2 lost too, before the survivors' end (MPI error class "
        f"{MPI.ERR_PROC_FAILED}; the failure detector takes a rank that stalls longer than "
        f"its timeout for dead)")


def test_survivors_that_never_come_end_the_wait_at_its_bound():
    survivors = _Comm([10, 12], 0)   # the barrier never completes
    assert ulfm.wait_for_survivors(survivors, 0.05) == (
        "the other survivors did not reach their end within 0.05 s")
