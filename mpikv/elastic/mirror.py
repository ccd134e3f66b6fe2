"""Buddy copies: what each owner holds, copied after every step and held by the next rank too.

Issue 28's ``redundancy="memory"``. After each step every rank copies the
values and optimizer states it owns (a checkpoint's part, in memory) and
passes the copy to its buddy, the next rank ``(r + 1) % n``, receiving its
predecessor's. The two newest copies of each are kept: survivors of a loss
may be one call apart, so one may hold step ``s`` where another holds only
``s - 1``.

After a loss, the survivors (on their new store) agree on the newest step of
which every survivor holds its own copy and, for every lost rank, its buddy
holds the lost rank's; each writes those copies as the part files of a
checkpoint of that step, which then loads on the survivors as any checkpoint
does (:mod:`mpikv.state.checkpoint`). No step is lost: the survivors go on from
the last step they all completed. A rank lost with its buddy leaves a part
nobody holds: nothing is written, and the survivors go on from the newest
periodic checkpoint instead, as after a loss before the first copy (a warning
on every survivor names the ranks).
"""

import numpy as np

from .. import errors, statefile
from ..calls.reader import Call
from ..logs import get_logger
from ..state.checkpoint import exchange, manifest_meta, on_host, owned_entries

log = get_logger(__name__)

#: copies kept of each kind (own, the predecessor's)
KEPT = 2


class Copy:
    """One rank's owned part of the store after one step.

    Attributes:
        step: the steps done.
        rank: the rank that owned it (in the store it was taken on).
        layout: ``[(key, name, start, stop, shape, dtype, offset, nbytes)]``.
        data: the arrays' bytes, one uint8 array.
        meta: the manifest's description of the store (:func:`manifest_meta`).
        extra: what the caller keeps with it (the Trainer's file), or None.
    """

    __slots__ = ("step", "rank", "layout", "data", "meta", "extra")

    def __init__(self, step, rank, layout, data, meta, extra):
        self.step, self.rank, self.layout = step, rank, layout
        self.data, self.meta, self.extra = data, meta, extra

    def header(self):
        return (self.step, self.rank, self.layout, self.meta, self.extra)

    @classmethod
    def from_header(cls, header, data):
        return cls(*header[:3], data, *header[3:])

    def entries(self):
        """The part file's entries (:func:`mpikv.statefile.write_part`)."""
        return [(key, name, start, stop, tuple(shape),
                 self.data[offset:offset + nbytes].view(np.dtype(dtype)))
                for key, name, start, stop, shape, dtype, offset, nbytes in self.layout]


def take(store, rows, step, extra, reuse=None):
    """This rank's :class:`Copy` of ``step``; ``reuse``: a dropped copy's buffer."""
    arrays = owned_entries(store, True, on_host, rows)
    layout, offset = [], 0
    for key, name, start, stop, shape, array in arrays:
        layout.append((key, name, start, stop, tuple(shape), array.dtype.str, offset,
                       array.nbytes))
        offset += array.nbytes
    data = reuse if reuse is not None and reuse.nbytes == offset else np.empty(offset, np.uint8)
    for (_, _, _, _, _, array), entry in zip(arrays, layout):
        data[entry[6]:entry[6] + entry[7]] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return Copy(step, store.transport.rank, layout, data,
                manifest_meta(store, "checkpoint", True, rows), extra)


class Mirror:
    """This rank's copies and its predecessor's (see the module's docstring).

    Args:
        store: the store's :class:`mpikv.core.engine.Engine`.
        rows: the store's :class:`~mpikv.rows.tables.RowTables`, or None.
    """

    def __init__(self, store, rows=None):
        self._store, self._rows = store, rows
        self.size = store.transport.size
        self.own = {}    # step -> Copy
        self.prev = {}   # step -> the predecessor's Copy

    def step(self, step, extra, what):
        """Copies this rank's part after ``step`` steps and passes it to the next
        rank; collective (every rank, in a store call)."""
        reuse = _oldest(self.own) if len(self.own) >= KEPT else None
        mine = take(self._store, self._rows, step, extra,
                    None if reuse is None else self.own.pop(reuse).data)
        self.own[step] = mine
        spare = self.prev.pop(_oldest(self.prev)).data if len(self.prev) >= KEPT else None
        header, data = self._store.transport.pass_along(mine.header(), mine.data, what, spare)
        theirs = Copy.from_header(header, data)
        self.prev[theirs.step] = theirs

    def steps(self):
        """``(own steps, predecessor's steps)`` held here."""
        return sorted(self.own), sorted(self.prev)


class Copies:
    """A store's buddy copies: ``kv.keep_copy`` and ``kv.restore_copies``.

    Args:
        protocol: the store's :class:`mpikv.store.protocol.Protocol` (runs each call).
        engine: the store's :class:`mpikv.core.engine.Engine`.
        rows: the store's :class:`mpikv.rows.tables.RowTables`.
    """

    def __init__(self, protocol, engine, rows):
        self.protocol, self.engine, self.rows = protocol, engine, rows
        self.mirror = None   # this rank's Mirror, from the first copy on

    def keep(self, step, extra=None):
        """Copies what this rank owns after ``step`` steps and passes the copy to the
        next rank, which keeps it (``redundancy="memory"``); collective.

        The two newest copies of this rank's part and of the previous rank's are
        kept. After a loss, :meth:`~mpikv.KVStore.restore_copies` on the survivors' store writes
        them as a checkpoint of the last step every survivor completed.

        Args:
            step: the steps done (the same on every rank).
            extra: anything picklable kept with the copy (the Trainer's file).
        """
        call = Call("keep_copy", settings={"step": step})
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            call.fail(errors.InputError, None, f"step must be an int >= 0, not {step!r}")

        def keep():
            if self.mirror is None:
                self.mirror = Mirror(self.engine, self.rows)
            self.mirror.step(step, extra, (call.op, []))
        # Not in the background: a rank that died before its copy left would take
        # that step with it (tried: a loss in the next step went back one further).
        self.protocol.collective(call, keep)

    def steps(self):
        """``(own steps, predecessor's steps)`` held here (``([], [])`` before any copy)."""
        return ([], []) if self.mirror is None else self.mirror.steps()

    def own(self, step):
        """This rank's :class:`Copy` of ``step`` (KeyError where none is held)."""
        if self.mirror is None:
            raise KeyError(step)
        return self.mirror.own[step]

    def restore(self, lost_store, lost, path_of, write_extra=None, older=None):
        """Writes the copies ``lost_store`` kept (:meth:`~mpikv.KVStore.keep_copy`) as a
        checkpoint of the newest step held whole; collective over this store, the survivors'.

        Args:
            lost_store: the store that lost the ranks (abandoned).
            lost: the :class:`mpikv.RankLostError` every survivor got.
            path_of: ``step -> path`` of the checkpoint.
            write_extra: ``(path, extra)`` run on the survivor holding the lost
                store's rank 0's ``extra``, before the checkpoint is committed.
            older: ``(store, loss)``: an older store whose copies serve where
                ``lost_store``'s hold no step whole (it was made by a recovery
                that a second loss cut short), and everything it lost
                (:func:`mpikv.elastic.mirror.combine`), the same on every survivor.

        Returns:
            The step written (load it with :meth:`~mpikv.KVStore.load_checkpoint`), or None
            where no step is held whole: no copy was taken yet, or a lost
            rank's buddy (the next rank) was lost too (a warning says so).

        Here ``lost_store`` (and ``older``'s store) is that store's :class:`Copies`.
        """
        candidates = [(lost_store.mirror, lost)]
        if older is not None:
            candidates.append((older[0].mirror, older[1]))
        return self.protocol.collective(Call("restore_copies"), lambda: restore(
            self.protocol.transport, candidates, path_of, write_extra))


def _oldest(copies):
    return min(copies)


def buddy(rank, size):
    """The rank that holds ``rank``'s copies."""
    return (rank + 1) % size


def lost_with_buddy(size, lost):
    """``[(rank, its buddy)]`` for each lost rank whose buddy was lost too."""
    return [(r, buddy(r, size)) for r in sorted(lost) if size > 1 and buddy(r, size) in lost]


def common_step(size, lost, held):
    """The newest step every part of the store is held for, after a loss.

    Args:
        size: the lost store's rank count.
        lost: its lost ranks.
        held: ``{survivor's old rank: (own steps, predecessor's steps)}``.

    Returns:
        The step, or None when no step is held whole: no copy taken yet, or a
        lost rank's buddy was lost too (its copies are gone).
    """
    if lost_with_buddy(size, lost) or not held:
        return None
    steps = set.intersection(*(set(own) for own, _ in held.values()))
    for r in lost:
        steps &= set(held.get(buddy(r, size), ((), ()))[1])
    return max(steps) if steps else None


class Loss:
    """The ranks a store lost, in its numbering: ``lost`` and ``survivors`` (sorted)."""

    __slots__ = ("lost", "survivors")

    def __init__(self, lost, survivors):
        self.lost, self.survivors = sorted(lost), list(survivors)

    def __eq__(self, other):
        return (self.lost, self.survivors) == (other.lost, other.survivors)

    def __repr__(self):
        return f"Loss(lost={self.lost}, survivors={self.survivors})"


def combine(first, then):
    """One :class:`Loss` of the store that lost ``first``: ``first``, then ``then`` (a
    loss among ``first``'s survivors, numbered in their order, as their new store or
    communicator numbers them)."""
    return Loss(list(first.lost) + [first.survivors[i] for i in then.lost],
                [first.survivors[i] for i in then.survivors])


def restore(transport, candidates, path_of, write_extra=None):
    """Writes the newest step that the survivors' copies hold whole as a checkpoint;
    collective over the survivors' new store.

    Args:
        transport: the survivors' store's transport (its ranks: each candidate's
            ``survivors``, in order).
        candidates: ``[(mirror, loss)]``, newest store first: this rank's
            :class:`Mirror` of a lost store (or None: no copies) and that store's
            loss (``.lost``, ``.survivors``, in its numbering). After a second loss
            during a recovery, the store that took the copies lost both: the loss
            of the newest store, then :func:`combine` of the older one's.
        path_of: ``step -> path`` of the checkpoint to write.
        write_extra: ``(path, extra)``: writes what the lost store's rank 0 kept
            with its copy (run on the one survivor that holds it, before the
            manifest makes the checkpoint visible).

    Returns:
        The step written, from the first candidate that holds a step whole; None
        where none does (nothing written): no copy taken yet, or a lost rank's
        buddy lost too (a warning says so).

    Raises:
        StateFileError: some survivor could not write (on every survivor).
    """
    what = ("restore copies", [])
    usable, held = [], []
    for mirror, loss in candidates:
        size = len(loss.lost) + len(loss.survivors)
        if mirror is not None and mirror.size != size:
            mirror = None   # the loss is of another store's ranks
        usable.append((mirror, loss, size))
        held.append(mirror.steps() if mirror is not None else ([], []))
    records = transport.allgather_records(
        {"held": held,
         "generation": statefile.new_generation() if transport.rank == 0 else None}, what)
    for index, (mirror, loss, size) in enumerate(usable):
        # (from the gathered records alone: alike on every survivor)
        step = common_step(size, loss.lost, {
            loss.survivors[i]: tuple(r["held"][index]) if index < len(r["held"]) else ((), ())
            for i, r in enumerate(records)})
        if step is not None:
            break
    else:
        gone = next(filter(None, (lost_with_buddy(size, loss.lost)
                                  for _, loss, size in usable)), None)
        if gone:
            log.warning("redundancy='memory': %s: no survivor holds what they owned; going "
                        "on from the newest periodic checkpoint", "; ".join(
                            f"rank {r} and its buddy rank {b} (which held its copy) were "
                            f"both lost" for r, b in gone))
        return None
    me = loss.survivors[transport.rank]
    path, generation = path_of(step), records[0]["generation"]
    mine = [mirror.own[step]] + [mirror.prev[step] for r in loss.lost if buddy(r, size) == me]
    holder = buddy(0, size) if 0 in loss.lost else 0

    def write_mine():
        if write_extra is not None and me == holder:
            write_extra(path, next(c.extra for c in mine if c.rank == 0))
        return [statefile.write_part(path, generation, c.rank, c.entries())
                for c in mine if c.layout]

    records = [r for part in exchange(transport, what, write_mine) for r in part]
    meta = mine[0].meta

    def commit():
        if transport.rank == 0:
            statefile.commit(path, generation, records, meta)

    exchange(transport, what, commit)
    return step


__all__ = ["Copies", "Copy", "Loss", "Mirror", "buddy", "combine", "common_step", "lost_with_buddy",
           "restore", "take"]
