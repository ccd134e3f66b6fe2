"""Exceptions raised by mpikv.

Every error of a collective call is raised on every rank of the store, with
the same class and message, so that ``except`` clauses stay in step.
"""


class MPIKVError(Exception):
    """Base class of every error mpikv raises on purpose.

    Attributes:
        first_rank: for an error that the ranks' agreement raised on every
            rank of a call alike, the ``COMM_WORLD`` rank that reports it first
            if it ends the job (the lowest rank that raised it; see
            :func:`mpikv.transport.watchdog.install_exception_hook`); None for
            an error of this rank alone.
    """

    first_rank = None


class InputError(MPIKVError, ValueError):
    """A call's arguments are wrong on at least one rank."""


class UnknownKeyError(InputError):
    """A key was used before ``init``."""


class DuplicateInitError(InputError):
    """A key was initialised twice."""


class KeyTypeError(InputError, TypeError):
    """A key is not an ``int`` or a ``str``, or int and str keys are mixed."""


class ValueTypeError(InputError, TypeError):
    """A value or output is missing or is not an array."""


class ShapeError(InputError):
    """A value or output has the wrong shape."""


class DTypeError(InputError, TypeError):
    """A value or output has the wrong or an unsupported dtype."""


class MismatchError(MPIKVError):
    """Ranks made different calls (operation, keys, shapes, dtypes, settings)."""


class StateFileError(MPIKVError):
    """A state or checkpoint file is missing, corrupt or not an mpikv file."""


class OptimizerError(MPIKVError):
    """An optimizer is missing or differs between ranks."""


class GradientError(MPIKVError):
    """A Trainer's gradients cannot be summed as they are (missing, or written late)."""


class ConcurrentCallError(MPIKVError):
    """A store was called from one thread while another thread of the same rank was
    in one of its calls: a store takes calls from one thread at a time."""


class FaultToleranceUnavailableError(MPIKVError):
    """``fault_tolerant=True`` was asked for where the MPI library or the launch has
    no ULFM (``scripts/mpirun.sh --ft``; see docs/fault-tolerance.md)."""


class LaunchError(MPIKVError):
    """The job was started in a way mpikv cannot run (``torchrun`` instead of ``mpiexec``)."""


class RankLostError(MPIKVError):
    """A rank of a fault-tolerant store died; raised on every survivor alike.

    Attributes:
        lost: the lost ranks, in the store's numbering (sorted).
        lost_world: the same ranks in ``MPI.COMM_WORLD``'s numbering.
        survivors: the store ranks still alive (sorted).
        comm: the survivors' communicator (an mpi4py communicator made by
            ``MPI_Comm_shrink``, the survivors ranked in their old order), on
            which a new store can be created; every call of the old store
            raises this error again.
        call: the number of the store's first call that not every survivor
            completed (its calls counted from 1 alike on every rank).
        completed_on: the survivors on which that call did complete (its data
            arrived before the death): usually empty; where not, those ranks
            are one call ahead of the others.
        completed_here: whether this rank is one of ``completed_on`` (the only
            attribute that differs between survivors).
    """

    def __init__(self, message, lost=(), lost_world=(), survivors=(), comm=None, call=None,
                 completed_on=(), completed_here=False):
        super().__init__(message)
        self.lost = list(lost)
        self.lost_world = list(lost_world)
        self.survivors = list(survivors)
        self.comm = comm
        self.call = call
        self.completed_on = list(completed_on)
        self.completed_here = bool(completed_here)


__all__ = [
    "MPIKVError", "InputError", "UnknownKeyError", "DuplicateInitError",
    "KeyTypeError", "ValueTypeError", "ShapeError", "DTypeError",
    "MismatchError", "StateFileError", "OptimizerError", "GradientError",
    "ConcurrentCallError", "FaultToleranceUnavailableError", "LaunchError", "RankLostError",
]
