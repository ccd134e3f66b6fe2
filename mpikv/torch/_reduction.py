"""The reduction of a step's gradients: hooks -> launch -> send -> status -> allreduce_grads."""

import torch
from torch.autograd import Variable

from . import status, tensors


def wire_compression(compression):
    """The store's compression parameters for a Trainer's ``compression=``.

    A type's name alone (``"bf16"``, ``"fp16"``, ``"2bit"``) stands for
    ``{"type": name}``; a 16-bit type gets error feedback unless the dict says
    ``"error_feedback": False``. Anything else goes to the store as it is (its
    checks raise there, on every rank).

    Args:
        compression: the Trainer's ``compression`` argument (not None).
    """
    if isinstance(compression, str):
        compression = {"type": compression}
    if isinstance(compression, dict) and compression.get("type") in ("fp16", "bf16"):
        compression = {"error_feedback": True, **compression}
    return compression


class GradientReduction:
    """Sums each bucket of gradients on its owners as soon as backward gives it.

    Each parameter's hook (:meth:`on_grad`) counts its bucket's gradients in;
    a full bucket leaves on the launcher (:meth:`launch`), in bucket order, so
    every rank issues the same calls in the same order. A step then ends the
    reductions (:meth:`send_all`) and sums the status of its gradients over
    the ranks once (:meth:`check`).

    Args:
        context: the :class:`~._context.StoreContext`.
        wiring: the :class:`~._wiring.ParamWiring`.
        step: the :class:`~._step.StepState`.
        status: the :class:`~.status.StepStatus`.
        rule: the owners' rule.
        half: the :class:`~.half.HalfGradients` of 16-bit parameters.
        shards: the :class:`~.param_shards.ParameterShards` (``shard="parameters"``),
            or None.
        averaging: backward leaves the averaged gradients in ``.grad``.
        error_unused: a parameter without a gradient is a GradientError.

    Attributes:
        half / averaging: as given.
        resumer: the :class:`~.resume.Resumer` of ``trainer.resume``, or None.
    """

    def __init__(self, context, wiring, step, status, rule, half, shards, averaging,
                 error_unused):
        self._context, self._wiring, self._step = context, wiring, step
        self._status, self._rule, self._shards = status, rule, shards
        self.half, self.averaging, self._error_unused = half, averaging, error_unused
        self.resumer = None

    def on_grad(self, index):
        """Parameter ``index``'s gradient is in: its bucket may leave."""
        s, w = self._step, self._wiring
        if self._shards is not None:   # its unit may give its weights back now
            self._shards.grad_ready(index)
        if self.averaging and s.sent:
            # A second backward before step(): its gradients accumulate on the
            # averaged ones, and the sum is reduced again, as DDP does (a
            # gradient of the first pass only is summed again, not zeroed).
            touched = s.touched
            s.discard()
            s.touched = touched
            # A rank that runs it alone issues pushes where the others sum the status:
            # the error should say so, not name the store's calls only.
            self._context.tell("backward")
        b = w.bucket_of[index]
        if s.launched[b]:  # its bucket is on the wire: do not touch the buffer
            s.late.append(w.names[index])
            return
        self.take(index)
        s.touched[index] = True
        if not s.sync or s.fired[index]:
            return
        s.fired[index] = True
        s.ready[b] += 1
        if self.averaging and not s.queued:
            s.queued = True
            Variable._execution_engine.queue_callback(self.allreduce_grads)
        # Buckets leave in order, so every rank issues the same calls in the same order.
        while s.next < len(w.buckets) and s.ready[s.next] == len(w.buckets[s.next]):
            self.launch(s.next)

    def launch(self, b):
        """Queues bucket ``b``'s reduction on the launcher (its agreement is a collective)."""
        s, w = self._step, self._wiring
        # Autograd's thread: no host synchronization, an event orders the push.
        device = w.bucket_device[b]
        tensors.torch_before_store(device)
        s.launched[b] = True
        s.next = b + 1
        for i in w.buckets[b]:
            s.versions[i] = w.grads[i]._version
        kv, keys, arrays = self._context.kv, w.bucket_keys[b], w.grad_arrays[b]
        handles = s.handles
        # Queued behind its push: the owners' sums reach every rank while backward goes on.
        gather = s.gathered[b] = self.averaging and not w.is_half(b)
        # shard="parameters": once a bucket's sums are on their owners, the rest of its
        # gradients goes at once, while backward goes on (on the launcher's thread:
        # the store runs its calls in order, so waiting there delays nothing after).
        launcher = self._context.launcher
        give_back = self._shards is not None and launcher.threaded

        def send():
            # On the launcher's thread, the bucket's GPU is made current, as autograd's
            # thread of that GPU has it. The store's handover records its event on this
            # thread's current stream there, which it never sets: the legacy default
            # stream (or cupy's per-thread one, a blocking stream ordered after it),
            # where torch_before_store queued the wait for torch's event before this
            # was queued: the push reads the gradients after torch wrote them.
            with tensors.device_scope(device):
                handles.append(kv.push_async(keys, arrays))
                if gather:
                    handles.append(kv.gather_gradients_async(keys))
            if give_back:
                kv.wait(handles[-1])
                w.release_gradients(buckets=[b])
        try:
            launcher.submit(send)
        except BaseException:   # inline: its agreement failed on every rank
            self._context.abandon()
            raise

    def reduce(self, gather=False):
        """Sums every gradient on its owners and checks the step's status."""
        self.send_all()
        self.check(gather)

    def take(self, index):
        """Copies a ``.grad`` a script replaced (or whose storage it swapped) into
        the store's buffer, and makes ``.grad`` a view of it again; one the buffer
        cannot hold exactly is left as it is and refused at the status sum.

        Returns:
            bool: whether a gradient of the script's was copied in.
        """
        w = self._wiring
        why = w.unfit(index)
        if why is not None:
            self._step.refused[index] = why
            return False
        self._step.refused.pop(index, None)
        return w.rewire(index)

    def send_all(self):
        """Ends every bucket's reduction (what backward has not started yet starts now)."""
        s, w = self._step, self._wiring
        if s.sent:
            return
        for i in range(len(w.params)):
            if s.launched[w.bucket_of[i]]:
                # Replaced (or its storage swapped), or changed in place, after its
                # bucket left.
                if not w.wired(i) or w.grads[i]._version != s.versions[i]:
                    s.late.append(w.names[i])
                continue
            if self.take(i):
                s.touched[i] = True  # a gradient assigned by hand counts as one
            if not s.touched[i]:
                w.grads[i].zero_()  # an unused parameter adds zeros
        for b in range(s.next, len(w.buckets)):
            self.launch(b)
        kv = self._context.settled()   # (the launcher drained: every handle is in)
        kv.wait(s.handles)
        w.store_done()
        s.handles = []
        s.sent = True
        if self._shards is not None:   # the owners have the sums: the rest goes
            w.release_gradients()

    def check(self, gather=False):
        """Sums the status of the step's gradients over the ranks, once per step.

        Args:
            gather: the step gathers the gradients (:meth:`allreduce_grads`):
                joined ranks must take part.
        """
        if self._step.checked:
            return
        self._context.settled().allreduce_(self.status_row(gather), tag=status.TAG)
        self._step.checked = True
        self.read_status()

    def status_row(self, gather):
        """This rank's part of the status sum (see :class:`.status.StepStatus`)."""
        s = self._step
        stop, save, written = (self.resumer.flags(self._context.settled().rank)
                               if self.resumer is not None else (False, False, False))
        return self._status.row(s.touched, s.cleared, s.late, gather, s.joined,
                                stop, save, written, refused=sorted(s.refused))

    def read_status(self):
        """Reads the summed status (the same on every rank, joined or not).

        Raises:
            GradientError: gradients were written late, set to None on some
                ranks only, or (``unused_parameters="error"``) left unused, on
                some rank; the step is discarded.
        """
        s = self._step
        verdict, error = self._status.read(self.averaging, self._error_unused)
        s.unused_everywhere = verdict.unused_everywhere
        s.joined_round = verdict.joined_round
        s.sender = self._status.last_training_rank() if s.sender_last else verdict.sender
        # The same on every rank: from now on until a step with no rank joined.
        self._rule.hyper_agreed = not s.joined_round
        s.gathering = verdict.gathering
        s.asked = (verdict.stop, verdict.save, verdict.written)   # for the resumer
        if error is not None:
            s.discard()
            raise error

    def first_training_rank(self):
        """The first rank that has not joined, as the last status sum said."""
        return self._status.first_training_rank()

    def allreduce_grads(self):
        """:meth:`mpikv.torch.Trainer.allreduce_grads` (see there)."""
        s, w = self._step, self._wiring
        s.queued = False
        if s.scaled:
            return
        self.send_all()
        if not self.averaging:
            # (with shard="optimizer" the status is checked at the step, after the
            # gradients are averaged: see reduce_for_step and joined.py)
            self.check(gather=True)
        kv = self._context.settled()
        scale = 1.0 / kv.num_workers
        for b, keys in enumerate(w.bucket_keys):
            if not w.is_half(b) and not s.gathered[b]:
                kv.gather_gradients(keys)
        w.store_done()
        with torch.no_grad():
            for i, grad in enumerate(w.grads):
                if not w.is_half(w.bucket_of[i]):
                    grad.mul_(scale)
        if self.half:
            self.half.gather(scale)
        s.scaled = True

    def reduce_for_step(self):
        """The reduction a step needs: with ``shard="optimizer"`` the averaged
        gradients everywhere (if no backward gave them yet: a gradient set by
        hand, or backward inside ``no_sync``), else the owners' sums. Once per
        step (``update`` and ``optimizer.step`` both come here)."""
        s, w = self._step, self._wiring
        if s.checked:
            return
        if self.averaging:
            self.allreduce_grads()
            for i in range(len(w.params)):
                if w.params[i].grad is None:
                    # Set to None since backward (frozen for this step, or a
                    # zero_grad): skipped, as torch's optimizers skip it, if every
                    # rank did so (see read_status).
                    w.rewire(i)
                    s.touched[i] = False
                    s.cleared[i] = True
                elif self.take(i):   # replaced since: the owners take it
                    s.touched[i] = True
            self.check(gather=True)
        else:
            self.reduce()


__all__ = ["GradientReduction", "wire_compression"]
