"""A torchrun launch of an mpikv script: refused at once.

torchrun starts N processes that MPI knows nothing of: each is an MPI job of
one rank, so an mpikv script would run N independent one-rank trainings (each
printing as rank 0, each writing the same checkpoint), or wait for ever for
torchrun's own rendezvous. torchrun's environment says so: ``WORLD_SIZE`` or
``LOCAL_WORLD_SIZE`` above 1 while ``MPI.COMM_WORLD`` has one rank.
"""

import os

from .. import errors

#: torchrun's variables that give the number of processes it started
TORCHRUN_SIZES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")


def torchrun_sizes(environ=None):
    """``{variable: value}`` of torchrun's size variables above 1 in ``environ``."""
    environ = os.environ if environ is None else environ
    found = {}
    for name in TORCHRUN_SIZES:
        try:
            value = int(environ.get(name, "1"))
        except ValueError:
            continue
        if value > 1:
            found[name] = value
    return found


def refuse_torchrun():
    """Raises LaunchError in a process torchrun started (see the module's text), or
    in a lone rank of ``mpikv run -n N`` (``world.refuse_a_lone_rank``); nothing
    (and no MPI call) elsewhere.

    Not collective: each of torchrun's processes is an MPI job of its own.
    """
    from ..transport import world
    world.refuse_a_lone_rank()
    found = torchrun_sizes()
    if not found:
        return
    if world.size() != 1:
        return
    n = max(found.values())
    said = ", ".join(f"{k}={v}" for k, v in found.items())
    raise errors.LaunchError(
        f"this process was started by torchrun ({said}) but MPI sees 1 rank: torchrun's "
        f"{n} processes would each train alone. mpikv's ranks are MPI's: launch with "
        f"`mpiexec -n {n} python SCRIPT` (or `scripts/mpirun.sh -n {n} ...`, or `srun`) "
        f"instead of torchrun")


__all__ = ["TORCHRUN_SIZES", "torchrun_sizes", "refuse_torchrun"]
