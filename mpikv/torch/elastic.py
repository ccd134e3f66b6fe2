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
3. a new store over the survivors, the Trainer made again on it with the
   arguments it was first made with, and ``resume`` again: it loads the newest
   complete checkpoint (on any number of ranks) and removes partial ones;
4. ``step_fn`` is called again from the step after that checkpoint.

A step function that takes its slice of a global batch from ``trainer.rank``
and ``trainer.num_workers`` therefore ends with the weights of an
uninterrupted run, at the cost of the steps since the checkpoint.
"""

import torch

from ..elastic import RecoveryChain, say_recovered
from ..errors import InputError, MPIKVError, RankLostError


def run(trainer, step_fn, steps, min_workers):
    """:meth:`mpikv.torch.Trainer.run` (see there)."""
    if not isinstance(min_workers, int) or isinstance(min_workers, bool) or min_workers < 1:
        # (on every rank, through the next call's agreement: not here alone)
        kv = trainer.kvstore
        kv.fail_next_call(InputError, f"trainer.run: min_workers must be a positive int, "
                                      f"not {min_workers!r}")
        kv.barrier()
    if not isinstance(steps, int):
        steps = list(steps)
    lost = None
    chain = RecoveryChain()
    while True:
        try:
            if lost is not None:   # (a loss during a recovery: recovered again)
                lost, survived = None, lost
                _recover(trainer, survived, min_workers, chain.begin(trainer._kv, survived))
                say_recovered("trainer.run", chain.lost(survived), trainer.num_update,
                              trainer.num_workers)
                chain.end()
            resumer = trainer._resumer
            if resumer is not None and resumer.since is None and trainer._kv.fault_tolerant:
                # (the same on every rank: resume's load is collective) A loss before
                # the first periodic checkpoint goes back to this start, not to the
                # weights some survivor holds then.
                resumer.save()
            for i in _todo(steps, trainer.num_update):
                step_fn(i)
            return trainer.num_update
        except RankLostError as exc:
            lost = exc
            chain.lost_again(exc)


def _todo(steps, done):
    """The steps still to make after ``done`` updates."""
    if isinstance(steps, int):
        return range(done, steps)
    return [i for i in steps if i >= done]


def _recover(trainer, lost, min_workers, older=None):
    """Every survivor alike: the Trainer made again over the survivors, from the
    latest complete checkpoint (or buddy copies: ``older`` as
    :meth:`mpikv.KVStore.restore_copies` takes it); or one MPIKVError where it
    cannot go on."""
    n = len(lost.survivors)
    resumed = getattr(trainer, "_resume_args", None)
    where = ("no checkpoints (call trainer.resume(directory, every=K) before trainer.run)"
             if resumed is None else
             f"the latest complete checkpoint is in {trainer._resume_args[0]} "
             f"(trainer.resume loads it on any number of ranks)")
    # Each test reads only what every survivor holds alike (the agreed error, the
    # Trainer's arguments): every survivor raises, or none.
    if n < min_workers:
        raise MPIKVError(f"trainer.run: {n} rank{'s survive' if n > 1 else ' survives'}, fewer than "
                         f"min_workers={min_workers} ({lost}); {where}") from lost
    if resumed is None:
        raise MPIKVError(f"trainer.run cannot go on after a lost rank with {where}: "
                         f"{lost}") from lost
    _rebuild(trainer, lost, older)


def _let_go(trainer):
    """Ends what the Trainer holds on the lost store, on this rank alone."""
    # (after a loss during a recovery, a remade Trainer may be half made)
    for hook in getattr(trainer, "_hooks", None) or ():
        hook.remove()
    for hook in getattr(trainer, "_forward_hooks", ()):
        hook.remove()
    if getattr(trainer, "_shards", None) is not None:   # shard="parameters": its hooks
        trainer._shards.remove()
    trainer._detach_sync_bn()
    try:
        trainer._launcher.close()
    except MPIKVError:
        pass   # its queued calls met the loss too
    if getattr(trainer, "_call_hook", None) is not None:
        trainer._call_hook.remove()
    if trainer._resumer is not None:
        trainer._resumer.abandon()
    trainer._kv.abandon()
    with torch.no_grad():   # the parameters were views of the lost store's buffers
        for p in trainer._params:
            p.data = p.data.clone()
            p.grad = None


def _rebuild(trainer, lost, older=None):
    """The Trainer made again on a new store over the survivors, then resumed."""
    made = dict(trainer._made_with)
    _let_go(trainer)
    trainer._remake(made, lost, older)


__all__ = ["run"]
