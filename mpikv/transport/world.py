"""What MPI says about this process and its job, outside any store.

:func:`rank_label` is for log lines and never initialises MPI;
:func:`job_facts` is ``mpikv info``'s part that asks MPI (collective).
"""

import sys

_THREAD_LEVELS = ("THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED", "THREAD_MULTIPLE")


def rank_label():
    """``"R/N"`` from ``MPI.COMM_WORLD``, or None when MPI is not up.

    None also when mpi4py is not imported, or MPI is finalised or broken: the
    caller (logging) then asks the launcher's environment. mpi4py is never
    imported here, so logging never initialises MPI.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                return f"{mpi.COMM_WORLD.Get_rank()}/{mpi.COMM_WORLD.Get_size()}"
        except Exception:  # a broken MPI must not break logging
            pass
    return None


def mpi_running():
    """Whether MPI is initialised and not yet finalised (never initialises it)."""
    return rank_label() is not None


def job_facts(comm=None):
    """Gathers the hosts of ``comm``'s ranks and the MPI library's facts; collective.

    Args:
        comm: an mpi4py intra-communicator (default ``MPI.COMM_WORLD``).

    Returns:
        On rank 0 a dict: ``mpi4py`` (version), ``mpi_library``,
        ``mpi_standard`` (``"3.1"``), ``thread_level`` (``"MPI_THREAD_MULTIPLE"``),
        ``size`` and ``hosts`` (``{host: [ranks]}``); None on the other ranks.
    """
    import mpi4py
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    names = comm.gather(MPI.Get_processor_name(), root=0)
    if comm.Get_rank() != 0:
        return None
    hosts = {}
    for rank, host in enumerate(names):
        hosts.setdefault(host, []).append(rank)
    level = MPI.Query_thread()
    return {
        "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().rstrip("\x00").strip(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": next((f"MPI_{n}" for n in _THREAD_LEVELS if getattr(MPI, n) == level),
                             str(level)),
        "size": comm.Get_size(),
        "hosts": hosts,
    }


# -- for code beside a store (a torch process group, a data sampler); these do
# initialise MPI ------------------------------------------------------------------------
def _comm(comm):
    from mpi4py import MPI
    _heartbeats()
    return MPI.COMM_WORLD if comm is None else comm


def _heartbeats():
    # MPI may have started just now (the first MPI call of mpikv.torch's
    # init_process_group, say): under --ft the detector watches this rank from here
    # on, and a torch process group, a model and a DDP wrapper made before the first
    # store took a rank for dead on a loaded machine (issue 40, item 7).
    from . import ulfm
    ulfm.heartbeat_for_launch()


def rank(comm=None):
    """This process's rank in ``comm`` (default ``MPI.COMM_WORLD``)."""
    return _comm(comm).Get_rank()


def size(comm=None):
    """The number of ranks in ``comm`` (default ``MPI.COMM_WORLD``)."""
    return _comm(comm).Get_size()


def refuse_a_lone_rank(environ=None):
    """Raises LaunchError when ``mpikv run -n N`` (N > 1) started this process but MPI
    gives it a job of one rank: the launcher's PMI and the MPI library did not meet,
    and the N processes would each run alone. Nothing elsewhere.

    Not collective: each such process is a job of its own. A process made by
    ``MPI_Comm_spawn`` (its own ``COMM_WORLD``) is not asked.
    """
    import os
    env = os.environ if environ is None else environ
    try:
        want = int(env.get("MPIKV_RUN_NP", "0"))
    except ValueError:
        return
    if want <= 1:
        return   # not launched by mpikv run: no MPI call
    from mpi4py import MPI
    from .. import errors
    _heartbeats()
    if MPI.COMM_WORLD.Get_size() != 1 or MPI.Comm.Get_parent() != MPI.COMM_NULL:
        return
    launcher = env.get("MPIKV_RUN_LAUNCHER", "the launcher")
    raise errors.LaunchError(
        f"mpikv run -n {want} started this process with {launcher}, but MPI sees a job of 1 "
        f"rank: the {want} processes would each run alone. The launcher and the MPI library "
        f"did not meet: with srun, a PMI the library speaks (Open MPI 5: --mpi=pmix); "
        f"mpiexec and mpi4py from one MPI library (mpikv run checks both; python -m mpikv "
        f"info names the library)")


def local_rank(comm=None):
    """This process's rank among the ranks of ``comm`` on its node; collective."""
    from mpi4py import MPI
    node = _comm(comm).Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def on_one_host(comm=None):
    """Whether every rank of ``comm`` runs on one node; collective."""
    from mpi4py import MPI
    return len(set(_comm(comm).allgather(MPI.Get_processor_name()))) == 1


def from_rank_0(value, comm=None):
    """Rank 0's ``value`` on every rank of ``comm``; collective."""
    return _comm(comm).bcast(value)


__all__ = ["job_facts", "mpi_running", "rank_label", "rank", "size", "local_rank",
           "on_one_host", "from_rank_0"]
