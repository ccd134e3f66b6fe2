"""Which MPI collectives move a bucket: a small measured table, or the user's choice.

Three ways to sum a bucket over ranks and give every rank the owners' values:

| name | push (default updater) | push to owners (updater, optimizer) | pull of stale values |
| --- | --- | --- | --- |
| ``allreduce`` | ``Allreduce`` in place | ``Allreduce`` in place (owners use their blocks) | ``Allgatherv`` |
| ``reduce_bcast`` | ``Reduce`` of each owner's block to it, then ``Bcast`` | ``Reduce`` of each block | ``Allgatherv`` |
| ``reduce_scatter`` | ``Reduce_scatter`` by owner blocks, then ``Allgatherv`` | ``Reduce_scatter`` | ``Allgatherv`` |

The table below comes from ``python -m mpikv.bench algorithms`` on this
project's 2-core test machine (2026-11-22, 2 ranks, Open MPI 5.0.11; MPICH
5.0.2 from the notes in the project's research): in-place ``Allreduce`` was
the fastest whole operation at every bucket size from 64 KiB to 64 MiB on both
libraries (Open MPI's ``Reduce_scatter`` runs at about 1 GB/s and MPICH's
``Reduce`` at 0.75 GB/s at 64 MiB; per-owner ``Reduce`` blocks were slower
than one ``Allreduce``). ``MPIKV_ALGORITHM`` overrides the table.
"""

import os

ALGORITHMS = ("allreduce", "reduce_bcast", "reduce_scatter")

# library family -> [(largest bucket in bytes, algorithm), ...], first match wins
TABLE = {
    "Open MPI": [(float("inf"), "allreduce")],
    "MPICH": [(float("inf"), "allreduce")],
}
DEFAULT = "allreduce"


def family(library_version):
    """"Open MPI", "MPICH" or "other" from ``MPI.Get_library_version()``."""
    text = library_version or ""
    if "Open MPI" in text:
        return "Open MPI"
    if "MPICH" in text or "MVAPICH" in text or "Intel(R) MPI" in text:
        return "MPICH"
    return "other"


def choose(library_version, nbytes, environ=None):
    """The algorithm for a bucket of ``nbytes``.

    Raises:
        ValueError: ``MPIKV_ALGORITHM`` names no algorithm.
    """
    env = os.environ if environ is None else environ
    forced = env.get("MPIKV_ALGORITHM", "").strip().lower()
    if forced and forced != "auto":
        if forced not in ALGORITHMS:
            raise ValueError(f"MPIKV_ALGORITHM={forced!r}; use one of "
                             f"{', '.join(ALGORITHMS)} or auto")
        return forced
    for limit, name in TABLE.get(family(library_version), []):
        if nbytes <= limit:
            return name
    return DEFAULT
