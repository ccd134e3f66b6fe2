"""``kv.run(step_fn, steps, directory, every=K)``: a store's loop that survives a lost rank.

The store's side of issue 28's ``redundancy="checkpoint"``, for the KVStore API
(the Trainer's is :mod:`mpikv.torch.elastic`). Every ``every`` steps the store
saves a checkpoint (``directory/step-<N>``, N the steps done; atomic: visible
once its manifest is in place); at the start the newest complete one is
loaded, or one of step 0 is saved. When a rank of a fault-tolerant store is
lost, every survivor gets the same :class:`mpikv.RankLostError`, wherever it
was; the loop then makes a new store over the survivors (the old one's type
and options), calls ``setup(kv)`` on it, loads the newest complete checkpoint
(on the new rank count) and calls ``step_fn(kv, i)`` again from the step
after it. Fewer than ``min_workers`` survivors: one
:class:`mpikv.MPIKVError` on every survivor.

:func:`run_loop` is the loop itself, as Horovod's ``run_fn(func, reset)``: the
work and the recovery are handed in, so that ``kv.run`` and the Trainer's
``run`` share it.
"""

from .. import errors
from . import mirror
from ..logs import get_logger
from .checkpoints import CheckpointDir, name_of

log = get_logger(__name__)


def newest_first(directory):
    """``[(step, path)]`` of the complete checkpoints in ``directory``, newest first."""
    return CheckpointDir(directory).newest_first()


def run_loop(what, body, recover, store):
    """Runs ``body`` until it returns, recovering from each lost rank; every survivor alike.

    A :class:`mpikv.RankLostError` raised anywhere in ``body`` or in a recovery
    (a loss during a recovery is recovered from in turn) calls ``recover`` and
    then ``body`` again.

    Args:
        what: the loop's name in the log ("kv.run").
        body: ``body(recovered)``: the work, from the newest state it finds.
            Once that state is restored it calls ``recovered(step, workers)``,
            which logs what a recovery just made lost (if one was made) and
            ends it. Its result is ``run_loop``'s.
        recover: ``recover(lost, older)``: rebuild on the survivors of ``lost``
            (the error); ``older`` as :meth:`mpikv.KVStore.restore_copies` takes
            it. May raise an :class:`mpikv.MPIKVError` (too few survivors).
        store: ``store()``: the store in use now (the one a loss is of).
    """
    lost = None
    chain = RecoveryChain()
    while True:
        try:
            survived = None
            if lost is not None:   # (a loss during a recovery: recovered again)
                lost, survived = None, lost
                recover(survived, chain.begin(store(), survived))

            def recovered(step, workers, survived=survived):
                if survived is not None:
                    say_recovered(what, chain.lost(survived), step, workers)
                chain.end()
            return body(recovered)
        except errors.RankLostError as exc:
            lost = exc
            chain.lost_again(exc)


#: the ways ``run`` rebuilds after a loss
REDUNDANCY = ("checkpoint", "memory")


def refuse_unless_positive(kv, what, **values):
    """Raises :class:`mpikv.InputError` on every rank (at the first collective
    call) where one of this rank's ``values`` is not a positive int; the other
    ranks would otherwise wait for it. Collective.

    Args:
        kv: the store whose next call fails.
        what: the caller's name in the message ("kv.run").
        **values: the numbers, by the names the message gives them.
    """
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            kv.refuse(errors.InputError, f"{what}: {name} must be a positive int, not {value!r}")


def refuse_too_few(what, lost, min_workers, where):
    """Raises :class:`mpikv.MPIKVError` when fewer than ``min_workers`` survived the
    loss ``lost`` (a :class:`mpikv.RankLostError`): the same on every survivor, as
    it reads only the agreed error.

    Args:
        what: the loop's name in the message ("kv.run").
        lost: the error every survivor got.
        min_workers: the fewest survivors to go on with.
        where: the end of the message: where the latest checkpoint is.
    """
    n = len(lost.survivors)
    if n < min_workers:
        raise errors.MPIKVError(
            f"{what}: {n} rank{'s survive' if n > 1 else ' survives'}, fewer than "
            f"min_workers={min_workers} ({lost}); {where}") from lost


def _check(kv, every, keep, min_workers, redundancy):
    """Raises on every rank (at the first collective call) where some rank's
    arguments are bad; the others would otherwise wait for it."""
    refuse_unless_positive(kv, "kv.run", every=every, keep=keep, min_workers=min_workers)
    if redundancy not in REDUNDANCY:
        kv.refuse(errors.InputError, f"kv.run: redundancy must be 'checkpoint' or 'memory', "
                                     f"not {redundancy!r}")


def run(kv, step_fn, steps, directory, every, keep, min_workers, setup, remake,
        redundancy="checkpoint"):
    """Calls ``step_fn(kv, i)`` for each step ``i``, with checkpoints; a lost rank
    costs the steps since the latest one (or, with ``redundancy="memory"``,
    only the step it was lost in), not the job. Collective.

    Loads the newest complete checkpoint of ``directory`` (or saves one of
    step 0), then saves one every ``every`` steps, keeping ``keep``. On a
    fault-tolerant store, a rank lost in any call (background ones
    included) is, on every survivor alike: a new store over the survivors
    (this one's type and options), ``setup(kv)`` on it, the newest complete
    checkpoint loaded, and ``step_fn`` called again from the step after it
    with the new store, whose ``rank`` and ``num_workers`` are the
    survivors'. See docs/fault-tolerance.md.

    Args:
        step_fn: ``step_fn(kv, i)`` makes step ``i`` on the store it is given.
        steps: an int ``N`` (steps from the checkpoint's to ``N - 1``) or the
            step numbers; after a recovery those done are skipped.
        directory: where the checkpoints go (every rank sees it).
        every: save after every this many steps.
        keep: how many complete checkpoints to keep.
        min_workers: the fewest survivors to go on with.
        setup: called with each new store before its checkpoint is loaded
            (``set_updater`` of a Python updater, which no checkpoint holds).
        redundancy: ``"checkpoint"``: go on from the newest checkpoint;
            ``"memory"``: after each step every rank also passes a copy of
            what it owns to the next rank (:meth:`~mpikv.KVStore.keep_copy`), and the
            survivors go on from the last step they all completed (a rank
            lost with the next rank: from the newest checkpoint).

    Returns:
        The store in use at the end: this one, or the survivors' after a loss.

    Raises:
        MPIKVError: on every survivor, when fewer than ``min_workers`` survive.

    ``remake`` is :func:`mpikv.store.factory.remake_store` (handed in: the store's
    module imports this one).
    """
    _check(kv, every, keep, min_workers, redundancy)
    checkpoints = CheckpointDir(directory)
    steps = steps if isinstance(steps, int) else list(steps)
    memory = redundancy == "memory"
    now = [kv]

    def recover(lost, older):
        lost_kv = now[0]
        now[0] = _survivors_store(lost_kv, lost, min_workers, directory, remake)
        if setup is not None:
            setup(now[0])
        if memory:   # the last step every survivor completed, as a checkpoint
            now[0].restore_copies(lost_kv, lost, lambda s: str(checkpoints.path_of(s)),
                                  older=older)

    def body(recovered):
        kv = now[0]
        done = _start(kv, checkpoints, keep)
        recovered(done, kv.num_workers)
        for i in todo(steps, done):
            step_fn(kv, i)
            done = i + 1
            if memory:
                kv.keep_copy(done)
            if done % every == 0:
                kv.save_checkpoint(str(checkpoints.path_of(done)))
                _prune(kv, checkpoints, keep)
        return kv
    return run_loop("kv.run", body, recover, lambda: now[0])


def _prune(kv, checkpoints, keep):
    """Rank 0 removes every checkpoint file but the newest ``keep`` complete ones."""
    if kv.rank == 0:
        checkpoints.prune(keep)


def _start(kv, checkpoints, keep):
    """Loads the newest complete checkpoint, or saves one of step 0; returns its
    step; collective."""
    if kv.rank == 0:
        checkpoints.directory.mkdir(parents=True, exist_ok=True)
    kv.barrier()   # (every rank then sees the same files)
    found = checkpoints.newest_first()
    if found:
        step, path = found[0]
        kv.load_checkpoint(str(path))
    else:
        step = 0
        kv.save_checkpoint(str(checkpoints.path_of(0)))
    _prune(kv, checkpoints, keep)
    return step


def todo(steps, done):
    """The steps still to make after ``done``: ``range(done, steps)`` for an int,
    else those of ``steps`` not below ``done``."""
    if isinstance(steps, int):
        return range(done, steps)
    return [i for i in steps if i >= done]



class RecoveryChain:
    """The buddy copies a recovery under way still needs, across losses during it.

    A recovery restores the copies of the store that lost ranks. A second loss
    during it is numbered as the survivors are: that store has then lost both
    (:func:`mpikv.elastic.mirror.combine`), and its copies may still cover them. Every
    survivor keeps the chain from the agreed losses alone; where one does not (a
    survivor that had finished the recovery), :func:`mpikv.elastic.mirror.restore` finds
    that copy missing on every survivor alike.
    """

    def __init__(self):
        self._chain = None   # (store, mirror.Loss) while a recovery is under way
        self._combined = False   # whether a loss came during it

    def begin(self, store, lost):
        """A recovery of ``store``'s loss ``lost`` begins (or begins again after a
        loss during one); returns the ``older`` of
        :meth:`mpikv.KVStore.restore_copies`: None, or an earlier store and all it lost."""
        older = self._chain
        self._chain = older or (store, mirror.Loss(lost.lost, lost.survivors))
        self._combined = older is not None
        return older

    def lost_again(self, lost):
        """A loss ``lost`` (during the recovery, if one is under way)."""
        if self._chain is not None:
            self._chain = (self._chain[0], mirror.combine(self._chain[1], lost))

    def lost(self, last):
        """Everything the recovery lost: ``last`` (its error), or, after a loss during
        it, the combined :class:`mpikv.elastic.mirror.Loss`."""
        return self._chain[1] if self._chain is not None and self._combined else last

    def end(self):
        """The recovery is done."""
        self._chain = None


def say_recovered(what, lost, step, workers):
    """Logs on each survivor what a recovery lost (a :class:`~mpikv.RankLostError`,
    or the :class:`~mpikv.elastic.mirror.Loss` of a store that lost more during the
    recovery) and the step it goes on from."""
    size = len(lost.lost) + len(lost.survivors)
    ranks = ", ".join(map(str, lost.lost))
    world = getattr(lost, "lost_world", lost.lost)
    if list(world) != list(lost.lost):   # (a store over some of the ranks)
        ranks += f" (world {', '.join(map(str, world))})"
    log.warning("%s: lost rank%s %s of %d; going on from step %d on %d rank%s", what,
                "s" if len(lost.lost) > 1 else "", ranks, size, step, workers,
                "s" if workers > 1 else "")


def _survivors_store(kv, lost, min_workers, directory, remake):
    """A store like ``kv`` over the survivors; or one MPIKVError (the same on every
    survivor: it reads only the agreed error)."""
    refuse_too_few("kv.run", lost, min_workers,
                   f"the latest complete checkpoint is in {directory} "
                   f"(load_checkpoint loads it on any number of ranks)")
    # No probing of the strategies for the new rank count: seconds lost at each loss.
    return remake(kv, lost, autotune=False)


__all__ = ["RecoveryChain", "name_of", "newest_first", "refuse_too_few", "refuse_unless_positive",
           "run", "run_loop", "say_recovered", "todo"]
