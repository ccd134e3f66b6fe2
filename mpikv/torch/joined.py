"""A joined rank's part in the other ranks' training steps (``Trainer.join``).

The store's join replays the other ranks' calls with zeros; the Trainer's
steps also hold sums whose arrays only the Trainer can give (its status, the
hyperparameters, the 16-bit gradients, the shared gradients, the buffers),
and an owners' update between the last sum and the pulls.
:class:`JoinedSteps` gives them, in the order the training ranks make them.
"""

from .. import _xp, errors
from . import buffers, syncbn


class JoinedSteps:
    """A joined rank's part in the others' training steps: the ``on_call`` of
    :meth:`mpikv.KVStore.join` in :meth:`Trainer.join`.

    A step of the ranks still training is: its bucket pushes, the status sum;
    when it gathers the gradients (:meth:`Trainer.allreduce_grads`), the
    ``gather_gradients`` calls and the 16-bit sum; the hyperparameter sum; when
    it gathers, one sum per gradient array (the first training rank's
    gradients); then the weight pulls. With ``shard="optimizer"`` the
    ``gather_gradients`` calls follow each push, and the 16-bit sum comes
    before the status. Before a step's forward come one or two sums of the
    module's buffers (tagged ``buffers``). The store moves the data, with zeros in
    the pushes; this class gives this rank's array for each sum in turn, and
    runs its owners' update after the last sum, before the pulls, as the
    training ranks do.

    Args:
        trainer: the joined :class:`Trainer`.
    """

    def __init__(self, trainer):
        self._trainer = trainer
        self._first_bucket = frozenset(trainer._bucket_keys[0]) if trainer._bucket_keys else None
        self._scale = None
        self._new_step()

    def _new_step(self):
        # (this rank's array, what to do with the sum) of each sum still to come
        t = self._trainer
        self._sums = [(lambda: t._status_row(False), self._after_status)]
        if t._averaging and t._half:
            # shard="optimizer": the 16-bit sums come before the status (allreduce_grads
            # at the end of backward); this rank's .grad comes with the shared gradients.
            self._sums.insert(0, (t._half.owned_flat, _ignore))

    def __call__(self, call):
        t = self._trainer
        if call.op == "allreduce_" and call.settings.get("tag") == buffers.TAG:
            return self._buffer_sum(call)
        if call.op == "allreduce_" and call.settings.get("tag") == syncbn.TAG:
            return None   # SyncBatchNorm's sums: no samples here (zeros)
        if call.op == "push" and not call.done and frozenset(call.keys) == self._first_bucket:
            # A step's reduction starts with its first bucket: the parts an abandoned
            # step recorded go, as the training ranks' zero_grad drops theirs.
            t._rule.discard()
            t._start_step()
            self._new_step()
        if call.op != "allreduce_":
            return None
        give, take = self._sums[0]
        if not call.done:
            return give()
        del self._sums[0]
        try:
            take(call.array)
        except errors.GradientError:   # the training ranks raised it: nothing was applied
            self._new_step()
            return None
        if not self._sums:
            t._update_owned(self._scale)
            t.num_update += 1
            t._start_step()
            self._new_step()
        return None

    def _buffer_sum(self, call):
        """A sum of the buffers' bytes before a forward (see :mod:`.buffers`): this
        rank sends nothing and takes the sender's buffers, as DDP's joined ranks do."""
        t = self._trainer
        if not call.done:
            return t._buffers.rows(None)
        # None: taken; else the sender had joined, and this rank sends the next sum.
        again = t._buffers.take(t._sender)
        if again is not None:
            t._sender = again
        return None

    def _after_status(self, _):
        t = self._trainer
        t._read_status()
        sums = []
        if t._gathering:
            t._scaled = True   # the update takes .grad back, as after allreduce_grads
            if t._half and not t._averaging:
                # This rank's sums of its 16-bit parts; its .grad comes with the
                # shared gradients below.
                sums.append((t._half.owned_flat, _ignore))
        sums.append((t._hyper.rows, self._take_hyperparameters))
        if t._gathering:
            sums.extend((self._zeroed(bits), _ignore) for bits in t._gradient_bits())
        self._sums = sums

    def _take_hyperparameters(self, _):
        t = self._trainer
        self._scale = t._hyper.take(t._first_training_rank())

    def _zeroed(self, bits):
        """Gives ``bits`` zeroed: the sum writes the first training rank's gradient into it."""
        def give():
            with _xp.on(bits):
                bits[...] = 0
            self._trainer._cuda_ready()   # MPI reads the memory directly
            return bits
        return give


def _ignore(_):
    pass


__all__ = ["JoinedSteps"]
