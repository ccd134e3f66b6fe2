"""The status of a training step's gradients, the same on every rank.

Errors found on some ranks only (gradients changed after their bucket left,
parameters unused, gradients set to None after backward) and who has joined
must be known on every rank before anything is applied: each rank fills its
row of one vector, and one ``kv.allreduce_`` (tagged ``status``) sums it.
"""

import numpy as np

from .. import errors

#: per rank: unused count, late count, the indices (+1) of the first few unused
#: parameters (so every rank can name them), the join ticket (0: still
#: training), whether the step gathers the gradients, and whether this rank asks
#: the job to stop after a checkpoint (a signal) or to save now (rank 0's clock),
#: and whether its part of a checkpoint written in the background is on disk; the
#: number of gradients it refused (replaced by a tensor the store cannot hold
#: exactly) and the index (+1) of the first
NAMED = 3
_JOIN, _GATHER, _STOP, _SAVE, _WRITTEN = 2 + NAMED, 3 + NAMED, 4 + NAMED, 5 + NAMED, 6 + NAMED
_REFUSED, _REFUSED_AT = 7 + NAMED, 8 + NAMED
_ROW = 9 + NAMED
#: the tag of the status sum
TAG = "status"


class StepStatus:
    """One step's status vector and what its sum says.

    Args:
        kv: the store.
        names: every parameter's key, by index.
    """

    def __init__(self, kv, names):
        self._kv, self._names = kv, names
        self._n = kv.num_workers
        # A row per rank, then per parameter the ranks that gave it a gradient
        # plus (n + 1) times those that set it to None after backward.
        self._vector = np.zeros(self._n * _ROW + len(names), np.float64)

    def _rows(self):
        return self._vector[:self._n * _ROW].reshape(-1, _ROW)

    def row(self, touched, cleared, late, gather, ticket=0, stop=False, save=False,
            written=False, refused=()):
        """This rank's part of the sum (the whole vector, its row filled).

        Args:
            touched: per parameter, whether this rank gave it a gradient.
            cleared: per parameter, whether its gradient was set to None after backward.
            late: names of gradients changed after their bucket left.
            gather: whether the step gathers the gradients.
            ticket: this rank's join ticket (nonzero: it has joined, and gives
                nothing else).
            stop, save: this rank asks for a checkpoint and the job's end (it
                got a signal), or for a checkpoint now (see :mod:`.resume`).
            written: this rank's part of a background checkpoint is on disk.
            refused: indices of the gradients refused (a ``.grad`` replaced by a
                tensor the store's buffer cannot hold exactly).
        """
        vector = self._vector
        vector[:] = 0
        row = self._rows()[self._kv.rank]
        if ticket:
            row[_JOIN] = ticket
            return vector
        # (a gradient set to None after backward is a choice, not a parameter unused)
        unused = [i for i in range(len(self._names)) if not touched[i] and not cleared[i]]
        row[0], row[1] = len(unused), len(late)
        row[2:2 + len(unused[:NAMED])] = [i + 1 for i in unused[:NAMED]]
        row[_GATHER] = gather
        row[_STOP], row[_SAVE], row[_WRITTEN] = stop, save, written
        if refused:
            row[_REFUSED], row[_REFUSED_AT] = len(refused), min(refused) + 1
        vector[self._n * _ROW:] = (np.asarray(touched, np.float64)
                                   + (self._n + 1) * np.asarray(cleared, np.float64))
        return vector

    def first_training_rank(self):
        """The lowest rank that had not joined, by the last sum."""
        return int(np.flatnonzero(self._rows()[:, _JOIN] == 0)[0])

    def last_training_rank(self):
        """The highest rank that had not joined, by the last sum."""
        return int(np.flatnonzero(self._rows()[:, _JOIN] == 0)[-1])

    def read(self, averaging, error_unused):
        """What the summed vector says (the same on every rank).

        Args:
            averaging: the Trainer's ``shard`` is ``"optimizer"`` (for the message).
            error_unused: ``unused_parameters="error"``.

        Returns:
            ``(verdict, error)``: ``verdict`` is a :class:`Verdict`; ``error``
            None, or the :class:`mpikv.GradientError` every rank raises.
        """
        rows = self._rows()
        used, cleared = np.divmod(self._vector[self._n * _ROW:], self._n + 1)[::-1]
        verdict = Verdict(
            unused_everywhere=frozenset(self._names[i] for i in np.flatnonzero(used == 0)),
            joined_round=bool(rows[:, _JOIN].any()),
            gathering=bool(rows[:, _GATHER].any()),
            sender=self.first_training_rank(),
            stop=bool(rows[:, _STOP].any()), save=bool(rows[:, _SAVE].any()),
            # (a joined rank's row says nothing: its write is committed later)
            written=bool(rows[:, _WRITTEN].all()))
        refused = [r for r in range(len(rows)) if rows[r, _REFUSED]]
        if refused:
            where = "; ".join(
                f"rank {r}: " + few([self._names[int(rows[r, _REFUSED_AT]) - 1]],
                                    limit=1, more=int(rows[r, _REFUSED]))
                for r in refused)
            return verdict, errors.GradientError(
                f"a .grad was replaced by a tensor its parameter's gradient buffer cannot "
                f"hold exactly ({where}): another shape, a sparse tensor, or a dtype whose "
                f"values the parameter's dtype does not hold (a float64 .grad of a float32 "
                f"parameter, a complex one); give .grad the parameter's dtype and shape; "
                f"nothing was applied")
        late = [r for r in range(len(rows)) if rows[r, 1]]
        if late:
            return verdict, errors.GradientError(
                f"gradients were changed after their reduction started, on rank(s) "
                f"{few(late)}; " + ("with shard='gradients' or 'parameters' (each gradient "
                                    "reduced to its owners only) .grad must not change between "
                                    "backward() and step() (shard='optimizer', the default, "
                                    "leaves the averaged gradients in .grad); "
                                    if not averaging else "")
                + "run backward once per step, or inside trainer.no_sync(); nothing was applied")
        partly = [self._names[i] for i in np.flatnonzero((cleared > 0) & (used > 0))]
        if partly:
            return verdict, errors.GradientError(
                f"gradients were set to None between backward() and step() on some ranks "
                f"only ({few(partly)}): the ranks would update them differently; set them "
                f"to None on every rank (skipped, as torch skips them), or on none; nothing "
                f"was applied")
        if error_unused and rows[:, 0].any():
            where = "; ".join(
                f"rank {r}: " + few([self._names[int(i) - 1] for i in rows[r, 2:2 + NAMED] if i],
                                    more=int(rows[r, 0]))
                for r in range(len(rows)) if rows[r, 0])
            return verdict, errors.GradientError(
                f"parameters got no gradient ({where}); nothing was applied")
        return verdict, None


class Verdict:
    """What a status sum says, besides errors.

    Attributes:
        unused_everywhere: keys no rank gave a gradient (skipped, as torch skips them).
        joined_round: some rank has joined.
        gathering: the step gathers the gradients.
        sender: the first rank still training.
        stop: some rank asks for a checkpoint and the job's end after this step.
        save: rank 0 asks for a checkpoint after this step.
        written: every rank's part of a background checkpoint is on disk.
    """

    __slots__ = ("unused_everywhere", "joined_round", "gathering", "sender", "stop", "save",
                 "written")

    def __init__(self, unused_everywhere, joined_round, gathering, sender, stop=False,
                 save=False, written=False):
        self.unused_everywhere, self.joined_round = unused_everywhere, joined_round
        self.gathering, self.sender = gathering, sender
        self.stop, self.save, self.written = stop, save, written


def few(items, limit=NAMED, more=None):
    """At most ``limit`` items, and how many more of ``more`` (default: of ``items``) there are."""
    items = [str(i) for i in items]
    total = len(items) if more is None else more
    rest = f" and {total - limit} more" if total > limit else ""
    return ", ".join(items[:limit]) + rest


__all__ = ["TAG", "StepStatus", "Verdict", "few"]
