"""How a store talks to its peers: one abstract base, one module per strategy.

``make_transport`` imports the MPI strategy only when a distributed store is
created, so a ``local`` store never initialises MPI.
"""


def make_transport(kind, comm=None, options=None):
    """Creates the transport for a store type.

    Args:
        kind: "local" (no peers) or "mpi".
        comm: an mpi4py intra-communicator (MPI only; default COMM_WORLD).
        options: resolved :class:`mpikv.store.config.Options` (MPI only).
    """
    if kind == "local":
        from .local import LocalTransport
        return LocalTransport()
    if kind == "mpi":
        from .mpi import MPITransport
        return MPITransport(comm, options)
    raise ValueError(f"unknown transport {kind!r}")
