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
"""

import re
import shutil
from pathlib import Path

from . import errors, mirror, statefile
from ._logging import get_logger

log = get_logger(__name__)

_NAME = re.compile(r"^step-(\d+)(?:$|\.)")


def name_of(step):
    """The checkpoint name of ``step`` steps done."""
    return f"step-{step:09d}"


def newest_first(directory):
    """``[(step, path)]`` of the complete checkpoints in ``directory``, newest first."""
    found = {}
    root = Path(directory)
    for entry in root.iterdir() if root.is_dir() else ():
        m = _NAME.match(entry.name)
        if m and entry.name == name_of(int(m.group(1))):
            try:
                statefile.read_manifest(str(entry))
            except (OSError, ValueError, errors.MPIKVError):
                continue   # a save that never finished: no manifest names its parts
            found[int(m.group(1))] = entry
    return sorted(found.items(), reverse=True)


def _prune(kv, directory, keep):
    """Rank 0 removes every checkpoint file but the newest ``keep`` complete ones."""
    if kv.rank != 0:
        return
    kept = {name_of(s) for s, _ in newest_first(directory)[:keep]}
    for entry in Path(directory).iterdir():
        m = _NAME.match(entry.name)
        if m and name_of(int(m.group(1))) not in kept:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _start(kv, directory, keep):
    """Loads the newest complete checkpoint, or saves one of step 0; returns its
    step; collective."""
    if kv.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    kv.barrier()   # (every rank then sees the same files)
    found = newest_first(directory)
    if found:
        step, path = found[0]
        kv.load_checkpoint(str(path))
    else:
        step = 0
        kv.save_checkpoint(str(directory / name_of(0)))
    _prune(kv, directory, keep)
    return step


def _todo(steps, done):
    if isinstance(steps, int):
        return range(done, steps)
    return [i for i in steps if i >= done]


#: the ways ``run`` rebuilds after a loss
REDUNDANCY = ("checkpoint", "memory")


def _check(kv, every, keep, min_workers, redundancy):
    """Raises on every rank (at the first collective call) where some rank's
    arguments are bad; the others would otherwise wait for it."""
    for name, value in (("every", every), ("keep", keep), ("min_workers", min_workers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            kv.fail_next_call(errors.InputError,
                              f"kv.run: {name} must be a positive int, not {value!r}")
            kv.barrier()
    if redundancy not in REDUNDANCY:
        kv.fail_next_call(errors.InputError, f"kv.run: redundancy must be 'checkpoint' or "
                                             f"'memory', not {redundancy!r}")
        kv.barrier()


def run(kv, step_fn, steps, directory, every, keep, min_workers, setup, create,
        redundancy="checkpoint"):
    """:meth:`mpikv.KVStore.run` (see there); ``create`` is :func:`mpikv.kvstore.create`
    (handed in: the store's module imports this one)."""
    _check(kv, every, keep, min_workers, redundancy)
    directory = Path(directory)
    steps = steps if isinstance(steps, int) else list(steps)
    memory = redundancy == "memory"
    lost = survived = None
    chain = RecoveryChain()
    while True:
        try:
            if lost is not None:   # (a loss during a recovery: recovered again)
                lost, survived, lost_kv = None, lost, kv
                older = chain.begin(lost_kv, survived)
                kv = _survivors_store(kv, survived, min_workers, directory, create)
                if setup is not None:
                    setup(kv)
                if memory:   # the last step every survivor completed, as a checkpoint
                    kv.restore_copies(lost_kv, survived, lambda s: str(directory / name_of(s)),
                                      older=older)
            done = _start(kv, directory, keep)
            if survived is not None:
                say_recovered("kv.run", chain.lost(survived), done, kv.num_workers)
            chain.end()
            for i in _todo(steps, done):
                step_fn(kv, i)
                done = i + 1
                if memory:
                    kv.keep_copy(done)
                if done % every == 0:
                    kv.save_checkpoint(str(directory / name_of(done)))
                    _prune(kv, directory, keep)
            return kv
        except errors.RankLostError as exc:
            lost = exc
            chain.lost_again(exc)


class RecoveryChain:
    """The buddy copies a recovery under way still needs, across losses during it.

    A recovery restores the copies of the store that lost ranks. A second loss
    during it is numbered as the survivors are: that store has then lost both
    (:func:`mpikv.mirror.combine`), and its copies may still cover them. Every
    survivor keeps the chain from the agreed losses alone; where one does not (a
    survivor that had finished the recovery), :func:`mpikv.mirror.restore` finds
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
        it, the combined :class:`mpikv.mirror.Loss`."""
        return self._chain[1] if self._chain is not None and self._combined else last

    def end(self):
        """The recovery is done."""
        self._chain = None


def say_recovered(what, lost, step, workers):
    """Logs on each survivor what a recovery lost (a :class:`~mpikv.RankLostError`,
    or the :class:`~mpikv.mirror.Loss` of a store that lost more during the
    recovery) and the step it goes on from."""
    size = len(lost.lost) + len(lost.survivors)
    ranks = ", ".join(map(str, lost.lost))
    world = getattr(lost, "lost_world", lost.lost)
    if list(world) != list(lost.lost):   # (a store over some of the ranks)
        ranks += f" (world {', '.join(map(str, world))})"
    log.warning("%s: lost rank%s %s of %d; going on from step %d on %d rank%s", what,
                "s" if len(lost.lost) > 1 else "", ranks, size, step, workers,
                "s" if workers > 1 else "")


def _survivors_store(kv, lost, min_workers, directory, create):
    """A store like ``kv`` over the survivors; or one MPIKVError (the same on every
    survivor: it reads only the agreed error)."""
    n = len(lost.survivors)
    if n < min_workers:
        raise errors.MPIKVError(
            f"kv.run: {n} rank{'s survive' if n > 1 else ' survives'}, fewer than "
            f"min_workers={min_workers} ({lost}); the latest complete checkpoint is in "
            f"{directory} (load_checkpoint loads it on any number of ranks)") from lost
    kv.abandon()
    options = kv.options
    # No probing of the strategies for the new rank count: seconds lost at each loss.
    options.update(fault_tolerant=True, autotune=False)
    return create(kv.type, comm=lost.comm, **options)


__all__ = ["RecoveryChain", "name_of", "newest_first", "run", "say_recovered"]
