"""The owners' update of a step, and the weights gathered back into the parameters."""

from ..arrays import xp as _xp
from .optimizers import MXNetRule


class OwnerUpdate:
    """The owners' side of a step: each owner updates its parts, then every rank
    gathers the weights (``optimizer.step``, :meth:`apply`).

    Args:
        context: the :class:`~._context.StoreContext`.
        reduction: the :class:`~._reduction.GradientReduction`.
        wiring: the :class:`~._wiring.ParamWiring`.
        step: the :class:`~._step.StepState`.
        rule: the owners' rule.
        sparse: the :class:`~.sparse.SparseWeights`, or None.
        hyper: the :class:`~.hyper.SharedHyperparameters`.
        shards: the :class:`~.param_shards.ParameterShards`, or None.
        copies: ``redundancy="memory"``: keep a buddy copy after each step.
        meta: a callable giving the Trainer file's contents (for the copies).
        optimizer: ``trainer.optimizer`` (its ``param_groups``, read at each step).
        replicas: ``shard="none"``: the :class:`~.replicas.Replicas` that update the
            parts others own here, instead of gathering them; or None.

    Attributes:
        resumer: the :class:`~.resume.Resumer` of ``trainer.resume``, or None.
    """

    def __init__(self, context, reduction, wiring, step, rule, sparse, hyper, shards, copies,
                 meta, optimizer, replicas=None):
        self._context, self._reduction, self._wiring = context, reduction, wiring
        self.replicas = replicas
        self._step, self._rule, self._sparse = step, rule, sparse
        self._hyper, self._shards, self._copies, self._meta = hyper, shards, copies, meta
        self._optimizer = optimizer
        self.resumer = None

    def set_scale(self, batch_size=None):
        """The gradient scale of the next :meth:`apply` (``trainer.update``): the
        average over the ranks (None), else the sum over ``batch_size``."""
        s, n = self._step, self._context.settled().num_workers
        if batch_size is None:
            s.scale = 1.0 if s.scaled else 1.0 / n
        else:  # after allreduce_grads the average is turned back into sum / batch_size
            s.scale = (n if s.scaled else 1.0) / batch_size
        # Sparse gradients are never gathered: each step's rows are summed on the owners.
        s.sparse_scale = 1.0 / (n if batch_size is None else batch_size)

    def apply(self):
        """The owners' update and the gathering of the weights (``optimizer.step``)."""
        s = self._step
        if self.resumer is not None:
            self.resumer.flush()
        self._reduction.reduce_for_step()
        scale = s.scale
        if scale is None:  # optimizer.step() called directly: as update()
            scale = 1.0 if s.scaled else 1.0 / self._context.settled().num_workers
        sparse_scale, s.sparse_scale = s.sparse_scale, None
        if self._sparse is not None:   # checked on every rank before anything changes
            try:
                self._sparse.prepare(self._optimizer.param_groups)
            except BaseException:
                s.discard()
                raise
        if s.joined_round:   # the joined ranks take part (see Trainer.join)
            self._hyper.share(scale)
            if s.gathering:
                self.share_gradients()
        replicas = self.replicas
        if replicas is not None and replicas.current(s.joined_round):
            skip = s.unused_everywhere
            self.update_owned(scale)
            replicas.update(scale, skip)   # the parts others own: here, not gathered
            self._wiring.cuda_ready()
        else:
            self.update_owned(scale)
            self.pull_weights()
            if s.joined_round:
                # A joined rank replays none of a copy: every rank drops its replicas
                # (JoinedSteps too) and the first step with no rank joined copies.
                self.drop_replicas()
            elif replicas is not None:   # (first step, or after a load: follow from now)
                replicas.copy_from_owners()
        if self._sparse is not None:   # the rows: pushed, updated on the owners, pulled
            self._sparse.apply(sparse_scale if sparse_scale is not None
                               else 1.0 / self._context.settled().num_workers)
        s.num_update += 1
        s.reset()
        if self.resumer is not None:   # a checkpoint due, or the job's end at a signal
            self.resumer.after_step(*s.asked)   # (made at the next iteration's start)
        if self._copies:
            self.keep_copy()

    def drop_replicas(self):
        """``shard="none"``: forgets the replicas of the others' state (a round with
        joined ranks, whose updates they did not follow); the next step with every
        rank training copies them again. Nothing otherwise."""
        if self.replicas is not None:
            self.replicas.forget()

    def keep_copy(self):
        """redundancy="memory": this step's owned parts, copied and passed to the
        next rank, with what the Trainer's file and the user's state would hold."""
        state = None if self.resumer is None else self.resumer.user_state()
        self._context.settled().keep_copy(self._step.num_update,
                                          {"trainer": self._meta(), "user": state})

    def update_owned(self, scale):
        """The owners' update of the parts they own, gradients times ``scale``."""
        s, rule = self._step, self._rule
        self._wiring.store_done()   # torch's update reads the sums, states and weights
        half = self._reduction.half
        if s.scaled and half:
            half.give_back()
        if isinstance(rule, MXNetRule) and rule.inner.lr_scheduler is None:
            rule.inner.lr = float(self._optimizer.param_groups[0]["lr"])
        rule.apply(scale, skip=s.unused_everywhere)
        self._wiring.cuda_ready()
        s.scale = None

    def share_gradients(self):
        """Every rank takes the first training rank's gradients, as changed (clipped)
        between ``allreduce_grads`` and ``update``: joined ranks did not change
        theirs, and they own parts too."""
        kv = self._context.settled()
        sender = kv.rank == self._reduction.first_training_rank()
        self._wiring.cuda_ready()
        for bits in self._wiring.gradient_bits():
            if not sender:
                with _xp.on(bits):   # on its GPU, whichever is current
                    bits[...] = 0
            self._context.settled().allreduce_(bits, tag="shared gradients")

    def pull_weights(self):
        """Every bucket's owners' parts, gathered in place into the parameters
        (with ``shard="parameters"``: each unit's forward gathers its own)."""
        if self._shards is not None:
            self._shards.release_all()
            return
        kv, w = self._context.settled(), self._wiring
        kv.wait([kv.pull_async(keys, out=values)
                 for keys, values in zip(w.bucket_keys, w.value_arrays)])
        w.store_done()

    def zero_grad(self):
        """``trainer.zero_grad()``: every gradient zeroed in place (they stay the
        store's buffers); a backward whose step never came is dropped, nothing applied."""
        if self.resumer is not None:   # a checkpoint due after the last step: now
            self.resumer.flush()
        self._context.between_steps()
        # (shard="parameters": zeros that cost no memory until written)
        self._wiring.zero_grads(release=self._shards is not None)
        if self._sparse is not None:   # as torch's zero_grad(): a sparse gradient is dropped
            self._sparse.zero_grad()

    def refuse_sparse(self, what):
        """Raises (on every rank: the same model) for torch-format optimizer state of
        sparse weights, which lives in their row tables."""
        if self._sparse is not None:
            from ..errors import OptimizerError
            raise OptimizerError(
                f"optimizer.{what}: the optimizer state of the sparse embedding weights "
                f"({', '.join(self._sparse.names)}) lives in their row tables on the owners; "
                f"use trainer.save_checkpoint and trainer.load_checkpoint")


__all__ = ["OwnerUpdate"]
