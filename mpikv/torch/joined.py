"""A joined rank's part in the other ranks' training steps (``Trainer.join``).

The store's join replays the other ranks' calls with zeros; the Trainer's
steps also hold sums whose arrays only the Trainer can give (its status, the
hyperparameters, the 16-bit gradients, the shared gradients, the buffers),
and an owners' update between the last sum and the pulls.
:class:`JoinedSteps` gives them, in the order the training ranks make them.
"""

from ..arrays import xp as _xp
from .. import errors
from . import buffers, syncbn, tensors


def join(pieces):
    """:meth:`mpikv.torch.Trainer.join` (see there), over the Trainer's
    :class:`~._pieces.Pieces`."""
    context, step, devices = pieces.context, pieces.step, pieces.wiring.devices
    context.between_steps()
    activity = f"called trainer.join() after step {step.num_update}"
    if pieces.sparse is not None:
        context.refuse(errors.InputError, (
            "trainer.join() is not supported with sparse embedding weights (their "
            "rows are pushed and pulled at each step): give every rank the same "
            "number of batches"), activity)
    if pieces.shards is not None:
        # The others gather weights unit by unit in their forwards, which a joined
        # rank cannot replay: a call of its own fails, on every rank, with this.
        context.refuse(errors.InputError, (
            "trainer.join() is not supported with shard='parameters' (every rank "
            "must run every step's forward): give every rank the same number of "
            "batches"), activity)
    step.joined = step.num_update + 1   # nonzero: its status row says "joined"
    context.tell("join")   # what the others' errors say of this rank meanwhile
    try:
        # The hyperparameters come with each step (SharedHyperparameters): the
        # store must not replace the rule with a plain optimizer of the others'.
        # (on the parameters' GPU: the replayed calls zero its buffers there)
        with tensors.device_scope(devices[0] if len(devices) == 1 else None):
            last = context.settled().join(on_call=JoinedSteps(
                pieces.reduction, pieces.update, step, pieces.wiring, pieces.buffers,
                pieces.hyper), follow_optimizer=False)
    finally:
        step.joined = 0
        step.discard()
        # Every rank leaves join() here: the next forward shares the buffers on
        # every rank alike, whatever forwards ran while this rank waited.
        step.share_next = True
    if pieces.hooks.shares_buffers:
        # DDP's join ends by broadcasting the last joiner's model: its buffers
        # (BatchNorm's statistics of its last batch) are every rank's from here.
        pieces.buffers.share(last)
    if pieces.update.replicas is not None:
        # shard="none": the joined rounds dropped the replicas; every rank holds the
        # whole state again from here (optimizer.state_dict() on one rank, say).
        pieces.update.replicas.copy_from_owners()
    return last


def like_ddp(pieces):
    """:meth:`mpikv.torch.Trainer.join_like_ddp` (see there), over the Trainer's
    :class:`~._pieces.Pieces`; on every rank alike, between steps."""
    step = pieces.step
    step.sender_last = True
    if not step.joined_round:   # every rank trains: the highest sends
        step.sender = pieces.context.kv.num_workers - 1


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
        reduction: the Trainer's :class:`~._reduction.GradientReduction`.
        update: its :class:`~._update.OwnerUpdate`.
        step: its :class:`~._step.StepState`.
        wiring: its :class:`~._wiring.ParamWiring`.
        buffers: its :class:`~.buffers.SharedBuffers`, or None.
        hyper: its :class:`~.hyper.SharedHyperparameters`.
    """

    def __init__(self, reduction, update, step, wiring, buffers, hyper):
        self._reduction, self._update, self._step = reduction, update, step
        self._wiring, self._buffers, self._hyper = wiring, buffers, hyper
        self._first_bucket = frozenset(wiring.bucket_keys[0]) if wiring.bucket_keys else None
        self._scale = None
        self._new_step()

    def _new_step(self):
        # (this rank's array, what to do with the sum) of each sum still to come
        r = self._reduction
        self._sums = [(lambda: r.status_row(False), self._after_status)]
        if r.averaging and r.half:
            # shard="optimizer": the 16-bit sums come before the status (allreduce_grads
            # at the end of backward); this rank's .grad comes with the shared gradients.
            self._sums.insert(0, (r.half.owned_flat, _ignore))

    def __call__(self, call):
        s = self._step
        if call.op == "allreduce_" and call.settings.get("tag") == buffers.TAG:
            return self._buffer_sum(call)
        if call.op == "allreduce_" and call.settings.get("tag") == syncbn.TAG:
            return None   # SyncBatchNorm's sums: no samples here (zeros)
        if call.op == "push" and not call.done and frozenset(call.keys) == self._first_bucket:
            # A step's reduction starts with its first bucket: the parts an abandoned
            # step recorded go, as the training ranks' zero_grad drops theirs.
            s.discard()
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
            self._update.update_owned(self._scale)
            self._update.drop_replicas()   # (as the training ranks drop theirs)
            s.num_update += 1
            s.reset()
            self._new_step()
        return None

    def _buffer_sum(self, call):
        """A sum of the buffers' bytes before a forward (see :mod:`.buffers`): this
        rank sends nothing and takes the sender's buffers, as DDP's joined ranks do."""
        if not call.done:
            return self._buffers.rows(None)
        # None: taken; else the sender had joined, and this rank sends the next sum.
        again = self._buffers.take(self._step.sender, self._step.sender_last)
        if again is not None:
            self._step.sender = again
        return None

    def _after_status(self, _):
        r, s = self._reduction, self._step
        r.read_status()
        sums = []
        if s.gathering:
            s.scaled = True   # the update takes .grad back, as after allreduce_grads
            if r.half and not r.averaging:
                # This rank's sums of its 16-bit parts; its .grad comes with the
                # shared gradients below.
                sums.append((r.half.owned_flat, _ignore))
        sums.append((self._hyper.rows, self._take_hyperparameters))
        if s.gathering:
            sums.extend((self._zeroed(bits), _ignore) for bits in self._wiring.gradient_bits())
        self._sums = sums

    def _take_hyperparameters(self, _):
        self._scale = self._hyper.take(self._reduction.first_training_rank())

    def _zeroed(self, bits):
        """Gives ``bits`` zeroed: the sum writes the first training rank's gradient into it."""
        def give():
            with _xp.on(bits):
                bits[...] = 0
            self._wiring.cuda_ready()   # MPI reads the memory directly
            return bits
        return give


def _ignore(_):
    pass


__all__ = ["JoinedSteps", "join"]
