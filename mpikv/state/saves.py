"""Checkpoints written while training goes on.

A save in the background copies what this rank owns (a
:class:`~mpikv.state.checkpoint.Snapshot`), writes the copy on a thread of its own
(no MPI call there: only the disk) and commits at a later collective call,
when every rank's part is on disk. A save therefore costs the copy, not the
write; the checkpoint is visible (its manifest in place) only once committed.

:class:`Saves` is a store's checkpoint piece: its collective saves and loads
(:mod:`mpikv.state.checkpoint`) and its background saves, committed in the order
they were made.
"""

import threading

from . import checkpoint
from .local import LocalStates
from .. import errors
from ..calls.reader import Call


class Saves:
    """A store's checkpoints and optimizer-state files, and its background saves.

    Args:
        protocol: the store's :class:`mpikv.store.protocol.Protocol` (runs each call).
        engine: the store's :class:`mpikv.core.engine.Engine`.
        rows: the store's :class:`mpikv.rows.tables.RowTables`.
    """

    def __init__(self, protocol, engine, rows):
        self.protocol, self.engine, self.rows = protocol, engine, rows
        self.pending = []   # background saves not yet committed, oldest first
        #: per-rank states of the layers above, in every checkpoint
        self.local = LocalStates()

    def save(self, fname):
        """``kv.save_checkpoint``: collective; earlier background saves commit first."""
        def save():
            self.finish()
            checkpoint.save(self.engine, str(fname), "checkpoint", True, True, self.rows,
                            self.local)
        self.protocol.collective(Call("save_checkpoint", settings={"fname": str(fname)}), save)

    def save_async(self, fname, on_commit=None):
        """:meth:`~mpikv.KVStore.save_checkpoint` written while training goes on; collective.

        Each rank copies what it owns now (the values, optimizer states and row
        tables: the call costs that copy) and writes the copy on a thread of
        its own. ``handle.wait()``, collective, commits the checkpoint once
        every rank's part is written; until then it is not visible, and a job
        that ends before leaves the previous checkpoints whole. A later
        :meth:`~mpikv.KVStore.save_checkpoint`, :meth:`~mpikv.KVStore.save_checkpoint_async`,
        :meth:`~mpikv.KVStore.load_checkpoint` or :meth:`~mpikv.KVStore.close` commits it
        first, and so does the end of the process when every rank ends it.

        Args:
            fname: the checkpoint's path.
            on_commit: called on rank 0 right after the checkpoint's manifest is
                in place (to put a file of the caller's beside it); if it has a
                ``before`` method, that is called on rank 0 right before the
                manifest is written. An exception either raises is raised by
                ``wait()`` on every rank.

        Returns:
            A :class:`~mpikv.state.saves.SaveHandle`: ``done()`` says (locally)
            whether this rank's part is written, ``wait()`` commits.
        """
        def start():
            self.finish()
            handle = SaveHandle(checkpoint.Snapshot(self.engine, str(fname), "checkpoint",
                                                    True, True, self.rows, local=self.local),
                                self.commit, on_commit)
            self.pending.append(handle)
            return handle
        return self.protocol.collective(
            Call("save_checkpoint_async", settings={"fname": str(fname)}), start)

    def load(self, fname, strict=False):
        """``kv.load_checkpoint``: collective; earlier background saves commit first."""
        def load():
            self.finish()
            checkpoint.load(self.engine, str(fname), "checkpoint", True, self.rows, self.local,
                            strict=strict)
        self.protocol.collective(Call("load_checkpoint", settings={
            "fname": str(fname), "strict": bool(strict)}), load)

    def save_states(self, fname, dump_optimizer):
        """Saves the optimizer state of every key; collective.

        Each owner writes its own part, in parallel; the file loads on any
        number of ranks. Needs a filesystem every rank can see.

        Args:
            fname: path of the manifest (parts go to ``fname + ".parts/"``).
            dump_optimizer: also store the optimizer's kind and
                hyperparameters, so :meth:`~mpikv.KVStore.load_optimizer_states` can rebuild it.
        """
        call = Call("save_optimizer_states",
                    settings={"fname": str(fname), "dump_optimizer": bool(dump_optimizer)})
        if self.engine.optimizer is None:
            call.fail(errors.OptimizerError, None, "no optimizer is set (use set_optimizer)")
        self.protocol.collective(call, lambda: checkpoint.save(
            self.engine, str(fname), "optimizer_states", False, dump_optimizer, self.rows))

    def load_states(self, fname):
        """``kv.load_optimizer_states``: collective."""
        call = Call("load_optimizer_states", settings={"fname": str(fname)})
        self.protocol.collective(call, lambda: checkpoint.load(
            self.engine, str(fname), "optimizer_states", False, self.rows))

    def commit(self, handle):
        """``handle.wait()``: the ranks agree, then the saves up to it commit."""
        call = Call("save_checkpoint_wait", settings={"fname": str(handle.fname)})
        self.protocol.collective(call, lambda: self.finish(handle))

    def finish(self, upto=None):
        """Commits the background saves in the order they were made (up to and
        including ``upto``; every one if None); inside an agreed call."""
        while self.pending:
            handle = self.pending.pop(0)
            handle.finish()
            if handle is upto:
                return

    def close(self):
        """Before the store closes: its background saves commit (collective; the same
        list on every rank)."""
        if self.pending and not self.protocol.closed:
            self.commit(self.pending[-1])

    def abandon(self):
        """Lets a store that lost a rank go, on this rank alone (no collective call:
        none can be made on it any more).

        Its background checkpoint writes end and are never committed: a checkpoint
        is visible only once committed (:mod:`mpikv.state.saves`), so none is left
        half-written in its place. Its worker thread is left (a daemon: every call
        of the lost store fails at once).
        """
        for handle in self.pending:
            handle.abandon()
        self.pending.clear()


class SaveHandle:
    """A checkpoint being written (:meth:`mpikv.KVStore.save_checkpoint_async`).

    Attributes:
        fname: the checkpoint's path.
        nbytes: bytes this rank copied (and writes).
    """

    def __init__(self, snapshot, commit, on_commit=None):
        self._snapshot, self._commit, self._on_commit = snapshot, commit, on_commit
        self.fname, self.nbytes = snapshot.fname, snapshot.nbytes
        self.committed = False
        # (at the process's priority: a thread that can only run on an idle core
        # starves while holding the GIL, and the training thread waits for it)
        self._thread = threading.Thread(target=snapshot.write, name="mpikv-save")
        self._thread.start()

    def done(self):
        """Whether this rank's part is written (local: the other ranks' may not be)."""
        return self._snapshot.written

    def wait(self):
        """Waits for every rank's part, then commits the checkpoint; collective.

        Raises:
            StateFileError: on every rank, when some rank could not write its
                part (nothing is committed; earlier checkpoints stay whole).
        """
        self._commit(self)

    def finish(self):
        """What :meth:`wait` runs once the ranks agreed: the write joined, the
        commit made (once; a failure is raised once too)."""
        if self.committed:
            return
        self._thread.join()
        self.committed = True
        self._snapshot.finish(self._on_commit)

    def abandon(self):
        """After a lost rank: lets this rank's write end, never commits it (no
        manifest names its parts, so it is never loaded; the next ``resume``
        removes it)."""
        self._thread.join()
        self.committed = True   # (nothing left to commit)

    def __repr__(self):
        state = "committed" if self.committed else ("written" if self.done() else "writing")
        return f"<mpikv.SaveHandle {self.fname} {state}>"


__all__ = ["SaveHandle", "Saves"]
