"""What the Trainer knows of the step under way, and what outlasts a step."""


class StepState:
    """The per-step flags of a Trainer, and the few that outlast a step.

    The pieces of a Trainer share one; :meth:`reset` starts the next step
    (after an update, a discarded step, a join), :meth:`discard` also forgets
    the parts the owners' rule recorded for it.

    Args:
        num_params: the number of trained (dense) parameters.
        num_buckets: the number of buckets.
        rule: the owners' rule (its ``discard()``).

    Attributes:
        touched: per parameter: got a gradient since the last reduction.
        fired: per parameter: its hook ran in this (synchronised) backward.
        versions: per parameter: ``.grad``'s torch version when its bucket left.
        cleared: per parameter: ``.grad`` set to None between backward and step.
        ready: per bucket: how many of its gradients are in.
        launched: per bucket: its reduction is on the wire.
        gathered: per bucket: its gather of the owners' sums follows its push.
        queued: the end of this backward averages ``.grad``.
        next: the next bucket to launch.
        handles: the handles of the launched calls.
        late: the keys of gradients written after their bucket left.
        refused: index -> why, of each ``.grad`` replaced by a tensor the store's
            buffer cannot hold exactly (see :meth:`._wiring.ParamWiring.unfit`).
        sent: every bucket's reduction has ended.
        checked: the status of the step's gradients was summed.
        scaled: ``.grad`` holds the average (``allreduce_grads`` ran).
        joined_round: some rank has joined (known after the status sum).
        gathering: the step gathers the gradients (likewise).
        unused_everywhere: keys no rank gave a gradient (likewise).
        num_update: the updates so far (outlasts the step, as the rest below).
        sync: outside ``no_sync``.
        joined: this rank's join ticket while in ``join()``, else 0.
        asked: the resumer's ``(stop, save, written)`` from the last status sum.
        scale: the gradient scale ``update`` set for ``optimizer.step``, or None.
        sparse_scale: the sparse rows' scale ``update`` set, or None.
        sender: the rank whose buffers the others take (the first training).
        sender_last: the sender is the last (highest) rank still training instead,
            as DDP's once its ``join()`` context was entered (:func:`.joined.like_ddp`).
        share_next: the next forward shares the buffers (DDP's rule).
        on_reset: called after each :meth:`reset` (the store context's words).
    """

    def __init__(self, num_params, num_buckets, rule):
        self._num_params, self._num_buckets, self._rule = num_params, num_buckets, rule
        self.num_update = 0
        self.sync = True
        self.joined = 0
        self.asked = (False, False, False)
        self.scale = None
        self.sparse_scale = None
        self.sender = 0
        self.sender_last = False
        self.share_next = True
        self.on_reset = None
        self.reset()

    def reset(self):
        """Starts the next step: the per-step flags as before any backward."""
        n, buckets = self._num_params, self._num_buckets
        self.touched = [False] * n
        self.fired = [False] * n
        self.versions = [0] * n
        self.cleared = [False] * n
        self.ready = [0] * buckets
        self.launched = [False] * buckets
        self.gathered = [False] * buckets
        self.queued = False
        self.next = 0
        self.handles = []
        self.late = []
        self.refused = {}
        self.sent = False
        self.checked = False
        self.scaled = False
        self.joined_round = False
        self.gathering = False
        self.unused_everywhere = frozenset()
        if self.on_reset is not None:
            self.on_reset()

    def discard(self):
        """Forgets the step: what the owners' rule recorded for it, then the flags."""
        self._rule.discard()
        self.reset()


__all__ = ["StepState"]
