"""Checkpoints written while training goes on.

A save in the background copies what this rank owns (a
:class:`~mpikv.checkpoint.Snapshot`), writes the copy on a thread of its own
(no MPI call there: only the disk) and commits at a later collective call,
when every rank's part is on disk. A save therefore costs the copy, not the
write; the checkpoint is visible (its manifest in place) only once committed.
"""

import threading


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


__all__ = ["SaveHandle"]
