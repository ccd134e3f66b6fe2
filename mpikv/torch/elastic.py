"""``trainer.run(step_fn, steps)``: a training loop that survives a lost rank.

With a fault-tolerant store (``Trainer(..., fault_tolerant=True)`` under
``scripts/mpirun.sh --ft``) a rank that dies is one agreed
:class:`mpikv.RankLostError` on every survivor, raised by whatever store call
each survivor was in (a step's reductions during backward included). The
loop catches it and goes on from the latest complete checkpoint of
``trainer.resume(directory, every=K)`` (issue 28's ``redundancy="checkpoint"``):

1. every survivor decides alike from the error (the agreed survivors): fewer
   than ``min_workers``, or no checkpoints, is one :class:`mpikv.MPIKVError`;
2. each lets the lost store go on its own (no collective call can be made on
   it): the Trainer's hooks and threads end, the parameters get their own
   memory, a checkpoint being written is never committed;
3. a new store over the survivors, the Trainer's pieces made again on it with the
   arguments it was first made with, and ``resume`` again: it loads the newest
   complete checkpoint (on any number of ranks) and removes partial ones;
4. ``step_fn`` is called again from the step after that checkpoint.

A step function that takes its slice of a global batch from ``trainer.rank``
and ``trainer.num_workers`` therefore ends with the weights of an
uninterrupted run, at the cost of the steps since the checkpoint.

The loop is ``kv.run``'s (:func:`mpikv.elastic.loop.run_loop`); this module hands
it the Trainer's work and recovery, as torchft and Horovod's frameworks hand
theirs to one loop.
"""

import dataclasses

from ..elastic.loop import refuse_too_few, refuse_unless_positive, run_loop, todo
from ..errors import MPIKVError


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What the loop needs of a Trainer to go on after a loss.

    Attributes:
        store: gives the Trainer's store as is (the lost one, once lost).
        resumer: gives the :class:`~.resume.Resumer`, or None.
        directory: gives ``trainer.resume``'s directory, or None before it.
        let_go: ends what the Trainer holds on the lost store, on this rank alone.
        remake: ``remake(lost, older)``: the Trainer's pieces made again on a new
            store over the survivors, then resumed.
    """

    store: object
    resumer: object
    directory: object
    let_go: object
    remake: object


def run(trainer, step_fn, steps, min_workers, recovery):
    """:meth:`mpikv.torch.Trainer.run` (see there); ``recovery``: the
    Trainer's :class:`Recovery`."""
    refuse_unless_positive(trainer.kvstore, "trainer.run", min_workers=min_workers)
    if not isinstance(steps, int):
        steps = list(steps)

    def body(recovered):
        recovered(trainer.num_update, trainer.num_workers)
        resumer = recovery.resumer()
        if resumer is not None and resumer.since is None and recovery.store().fault_tolerant:
            # (the same on every rank: resume's load is collective) A loss before
            # the first periodic checkpoint goes back to this start, not to the
            # weights some survivor holds then.
            resumer.save()
        for i in todo(steps, trainer.num_update):
            step_fn(i)
        return trainer.num_update

    def recover(lost, older):
        _recover(recovery, lost, min_workers, older)
    return run_loop("trainer.run", body, recover, recovery.store)


def _recover(recovery, lost, min_workers, older=None):
    """Every survivor alike: the Trainer's pieces made again over the survivors, from the
    latest complete checkpoint (or buddy copies: ``older`` as
    :meth:`mpikv.KVStore.restore_copies` takes it); or one MPIKVError where it
    cannot go on."""
    directory = recovery.directory()
    where = ("no checkpoints (call trainer.resume(directory, every=K) before trainer.run)"
             if directory is None else
             f"the latest complete checkpoint is in {directory} "
             f"(trainer.resume loads it on any number of ranks)")
    # Each test reads only what every survivor holds alike (the agreed error, the
    # Trainer's arguments): every survivor raises, or none.
    refuse_too_few("trainer.run", lost, min_workers, where)
    if directory is None:
        raise MPIKVError(f"trainer.run cannot go on after a lost rank with {where}: "
                         f"{lost}") from lost
    recovery.let_go()
    recovery.remake(lost, older)


__all__ = ["Recovery", "run"]
