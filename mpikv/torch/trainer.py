"""The Trainer: a torch model's gradients, optimizer and weights on an mpikv store.

The Trainer is a face over pieces, each in its own module: the checked
arguments (:mod:`._options`), the store and launcher (:mod:`._store`), the
parameters wired into the store (:mod:`._wiring`), the state of the step under
way (:mod:`._step`), the store as the Trainer's calls see it (:mod:`._context`),
the reduction of the gradients (:mod:`._reduction`), the owners' update
(:mod:`._update`), the hooks on the model (:mod:`._module_hooks`) and the torch
optimizer face (:mod:`.optimizer_face`).
"""

import contextlib

import torch

from ..closing import ClosesAfterWith
from .. import errors
from . import checkpoint, ddp
from ._options import TrainerOptions
from ._pieces import make_pieces
from ._store import store_for
from .joined import join, like_ddp
from .optimizers import Deferred

#: format tag of the Trainer's part of a checkpoint
CHECKPOINT_FORMAT = checkpoint.FORMAT


class Trainer(ClosesAfterWith):
    """Data-parallel training of a torch model on an mpikv store.

    Every parameter's storage and gradient are views into the store's
    buffers. During backward, each bucket of gradients starts its reduction
    as soon as its last gradient is ready; ``step`` waits for them, lets each
    owner update its parts with the optimizer (so optimizer state is sharded
    over the ranks), and gathers the weights back into the parameters.

    Args:
        params: a ``torch.nn.Module``, its ``named_parameters()``, or a list of
            param-group dicts whose ``"params"`` are either. Names are the keys;
            parameters with ``requires_grad=False`` are skipped; tied
            parameters count once.
        optimizer: a ``torch.optim.Optimizer`` class (torch's or the user's; not
            ``LBFGS`` or ``SparseAdam``), an :class:`mpikv.optimizer.Optimizer`, or
            an mpikv optimizer's name. The owners run torch's own arithmetic on
            their parts.
        optimizer_params: keyword arguments of the optimizer class.
        kvstore: a store, or a store type; default ``dist_sync`` when MPI has
            more than one rank, else ``local`` (``_device`` variants for CUDA
            parameters).
        bucket_bytes: the most gradient bytes reduced by one asynchronous call.
        unused_parameters: ``"zeros"`` (a parameter that got no gradient adds
            zeros) or ``"error"`` (a :class:`mpikv.GradientError` on every rank,
            naming the parameters and ranks).
        lr_scheduler: a callable that takes :attr:`optimizer` and returns a
            torch LR scheduler; it becomes :attr:`lr_scheduler` and is saved in
            checkpoints.
        multi_precision: keep float32 master copies of float16 and bfloat16
            parameters (and their optimizer state in float32) on the owners,
            update them there and round once into the parameters; default: on
            when the model has 16-bit parameters.
        compression: gradient compression of the pushes, as
            :meth:`mpikv.KVStore.set_gradient_compression` takes it:
            ``{"type": "2bit", "threshold": t}`` (MXNet's, with the residual
            kept on each rank), ``{"type": "fp16"}`` or ``{"type": "bf16"}``
            (or the name alone), these two with error feedback (each rank
            keeps what rounding lost and sends it the next step; the owners
            sum in float32) unless ``"error_feedback": False``.
            float32 parameters only. Where ``.grad`` gets the average
            (``shard="none"`` or ``"optimizer"``, and :meth:`allreduce_grads`) a
            16-bit codec gathers the owners' sums in 16 bits too, each owner
            rounding its sums with a residual of its own; 2bit gathers float32.
            Default: none.
        shard: what lives on the owners only. ``"optimizer"`` (ZeRO-1): the
            optimizer state; when ``backward()`` returns, every ``.grad`` holds the
            gradient averaged over the ranks, as with DDP, so a script may clip,
            scale or inspect it before :meth:`step`; the owners update their parts
            and every rank gathers the weights (1.5 x DDP's bytes). ``"none"``: the
            same ``.grad``, but every rank also updates the parts others own, with a
            replica of their optimizer state, so nothing is gathered after the step
            (DDP's bytes and memory; the same weights bit for bit; torch optimizer
            classes, no 16-bit parameters). Without ``shard=`` or compression the
            store's layout chooses between these two (:attr:`shard_reason` says
            why): ``"optimizer"`` on one host, ``"none"`` across hosts where the
            weights' gather would cost more than the update and the replicated
            state fits in memory. ``"gradients"`` (the default with compression):
            each gradient is also reduced to its owners only (half the traffic of
            an allreduce); ``.grad`` must then not be changed between
            ``backward()`` and :meth:`step` (a :class:`mpikv.GradientError` on
            every rank, nothing applied) and holds the average only where this
            rank owns it, unless :meth:`allreduce_grads` gathers it.
        broadcast_buffers: as DDP's: before a forward, if the forward before
            it (or none) ran with gradients enabled and outside :meth:`no_sync`,
            every rank takes the module's buffers (BatchNorm's running
            statistics) from rank 0, or from the first rank still training
            after a :meth:`join`. Default: on given a module (``params`` or ``module``; the
            buffers are found on it); buffers are in checkpoints then. The
            module's ``torch.nn.SyncBatchNorm`` layers (from
            ``SyncBatchNorm.convert_sync_batchnorm``) sum their batch
            statistics over the ranks through the store, switch or not.
        split_parameters: whether an owner's part may be a flat shard of a
            parameter (True) or is always whole parameters (False: each
            parameter on one owner, as ``ZeroRedundancyOptimizer`` partitions
            them; the store never splits them). Default: shards for torch's
            elementwise optimizers (SGD, Adam, AdamW, Adagrad, Adadelta,
            Adamax, NAdam, RAdam, RMSprop, ASGD, Rprop) and mpikv's; whole
            parameters for any other class (``Adafactor``, a user's LAMB).
            True for another class asserts that its update is elementwise.
        module: the model, when ``params`` are its (named) parameters or param
            groups rather than the module: its buffers and SyncBatchNorm layers
            are then handled as for a module given as ``params``.
        fault_tolerant: the store the Trainer makes is fault tolerant (a lost rank
            is one :class:`mpikv.RankLostError` on every survivor; needs
            ``scripts/mpirun.sh --ft``); with :meth:`resume` and :meth:`run` the
            survivors go on from the latest checkpoint. Default
            ``MPIKV_FAULT_TOLERANT`` or off; a store passed as ``kvstore`` keeps its own.
        min_workers: the fewest ranks :meth:`run` goes on with after a loss.
        redundancy: how :meth:`run` rebuilds after a loss: ``"checkpoint"`` (the
            default: from the newest checkpoint of :meth:`resume`) or ``"memory"``
            (after every step each rank also passes a copy of the weights and
            optimizer state it owns to the next rank; the survivors go on from
            the last step they all completed). Needs a fault-tolerant store.
        sync: None (every step is synchronous) or :class:`mpikv.torch.DiLoCo`
            (local inner steps with ``optimizer``, a sync through the owners'
            outer optimizer every ``every`` steps; see docs/torch.md "DiLoCo").

    Attributes:
        kvstore: the store.
        optimizer: a ``torch.optim.Optimizer`` whose ``param_groups`` hold the
            hyperparameters (torch schedulers change them there); its ``step``
            is :meth:`update`. Its ``state`` stays empty: the state lives on
            the owners.
        lr_scheduler: the scheduler made from ``lr_scheduler``, or None.
        num_update: the number of updates so far.
        shard: the sharding it runs (as given, or as the layout chose).
        shard_reason: why that sharding ("shard= given", or the measurement).
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore=None, *,
                 bucket_bytes=8 << 20, unused_parameters="zeros", lr_scheduler=None,
                 multi_precision=None, compression=None, shard=None, broadcast_buffers=None,
                 split_parameters=None, module=None, units=None, fault_tolerant=None,
                 min_workers=1, redundancy="checkpoint", sync=None):
        if not isinstance(params, (torch.nn.Module, list, tuple)):
            params = list(params)   # (named_parameters(): read again by a recovery)
        self._options = opts = TrainerOptions(dict(
            params=params, optimizer=optimizer, optimizer_params=optimizer_params,
            kvstore=kvstore, bucket_bytes=bucket_bytes, unused_parameters=unused_parameters,
            lr_scheduler=lr_scheduler, multi_precision=multi_precision, compression=compression,
            shard=shard, broadcast_buffers=broadcast_buffers, split_parameters=split_parameters,
            module=module, units=units, fault_tolerant=fault_tolerant, min_workers=min_workers,
            redundancy=redundancy, sync=sync))
        self.shard, self.split_parameters = opts.shard, opts.split_parameters
        self.min_workers = min_workers
        self._resumer = self._resume_args = None
        owns_store = kvstore is None or isinstance(kvstore, str)
        store = store_for(opts)
        try:
            self._build(store, owns_store=owns_store)
        except BaseException as exc:
            # Nobody else holds the store; a refusal is agreed, so close is collective.
            if owns_store and isinstance(exc, errors.MPIKVError):
                store.close()
            elif owns_store:
                store.abandon()
            raise
        ddp.attach(self, self._wiring.params)   # a DDP wrapper's forward checks for it

    def _build(self, kv, owns_store):
        """Makes every piece on the store ``kv`` and puts them in place (at first, and
        on the survivors' store after a loss)."""
        self._pieces = p = make_pieces(self._options, kv, self)
        self._wiring, self._step, self._context = p.wiring, p.step, p.context
        self._reduction, self._update, self._hooks, self._shards = (p.reduction, p.update,
                                                                    p.hooks, p.shards)
        self._sparse, self._file = p.sparse, p.file
        self._owns_store, self._closed, self.optimizer = owns_store, False, p.optimizer
        self.shard, self.shard_reason = p.shard, p.shard_reason

    @property
    def rank(self):
        """This rank in the Trainer's store (after a loss: among the survivors)."""
        return self._context.kv.rank

    @property
    def num_workers(self):
        """The number of ranks training (after a loss: the survivors)."""
        return self._context.kv.num_workers

    @property
    def num_update(self):
        """The number of updates so far."""
        return self._step.num_update

    @num_update.setter
    def num_update(self, value):
        self._step.num_update = value

    kvstore = property(lambda self: self._context.settled(),
                       doc="The store (after the calls backward queued).")

    @property
    def lr_scheduler(self):
        """The scheduler made from ``lr_scheduler``, or None (saved in checkpoints)."""
        return self._file.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, value):
        self._file.lr_scheduler = value

    def run(self, step_fn, steps, *, min_workers=None):
        """Calls ``step_fn(i)`` for each step ``i``; a lost rank costs the steps since
        the latest checkpoint, not the job. Collective.

        ``step_fn(i)`` makes the ``i + 1``-th update (one :meth:`step`). With
        ``fault_tolerant=True`` and :meth:`resume` (``every=K``), a rank lost in
        any step (a ``kill -9``, a node gone) is, on every survivor alike: a new
        store over the survivors, the Trainer's pieces made again on it (``trainer.optimizer``
        and ``trainer.lr_scheduler`` are new objects then), the latest complete
        checkpoint loaded, and ``step_fn`` called again from the step after it,
        with :attr:`rank` and :attr:`num_workers` the survivors'. A step function
        that takes its slice of a global batch from those two therefore ends with
        the weights of an uninterrupted run. See docs/fault-tolerance.md.

        Args:
            step_fn: called with each step's number.
            steps: an int ``N`` (the steps from :attr:`num_update` to ``N - 1``) or
                the step numbers; after a recovery those below :attr:`num_update`
                are skipped.
            min_workers: the fewest survivors to go on with (default the
                Trainer's ``min_workers``, 1).

        Returns:
            int: :attr:`num_update` at the end.

        Raises:
            mpikv.MPIKVError: on every survivor, when fewer than ``min_workers``
                survive, or a rank is lost without :meth:`resume`'s checkpoints.
        """
        from .elastic import run
        return run(self, step_fn, steps, self.min_workers if min_workers is None else min_workers,
                   self._recovery())

    def _recovery(self):
        """What :mod:`.elastic` needs of this Trainer to go on after a loss."""
        from .elastic import Recovery
        return Recovery(store=lambda: self._context.kv, resumer=lambda: self._resumer,
                        directory=lambda: self._resume_args and self._resume_args[0],
                        let_go=self._let_go, remake=self._remake)

    def _let_go(self):
        """Ends what the Trainer holds on the lost store, on this rank alone."""
        if self._resumer is not None:
            self._resumer.abandon()
        self._pieces.let_go()

    def _remake(self, lost, older=None):
        """After a lost rank (once the lost store was let go): the pieces made again
        on a new store over the survivors of ``lost`` and swapped in, then resumed
        from the newest complete checkpoint (with buddy copies: first written from
        them, ``older`` as :meth:`mpikv.KVStore.restore_copies` takes it)."""
        directory, every, resume_options = self._resume_args
        lost_store = self._context.kv
        store = store_for(self._options, survivors=lost)
        try:
            self._build(store, owns_store=True)
        except BaseException:   # lost again while building: nothing else holds this store
            store.abandon()
            raise
        self._resumer = None
        if self._options.copies:   # the last step every survivor completed, as a checkpoint
            from .resume import checkpoint_path, write_copy_extra
            store.restore_copies(lost_store, lost, lambda step: checkpoint_path(directory, step),
                                 write_copy_extra, older=older)
        self.resume(directory, every, **resume_options)

    def allreduce_grads(self):
        """Averages the gradients over the ranks; every rank then holds them all.

        With the default ``shard="optimizer"`` the end of ``backward()`` does
        it, and a second call does nothing until the next backward. With
        :meth:`update` it splits a step in two, so gradients can be changed in
        between (clipped, say): ``.grad`` holds the average over the ranks,
        whole, on every rank.
        """
        self._reduction.allreduce_grads()

    def update(self, batch_size=None):
        """The owners update their parts; the weights land back in the parameters.

        Args:
            batch_size: None: gradients are averaged over the ranks (as DDP
                does); else they are summed and divided by ``batch_size`` (as
                Gluon's ``step(batch_size)`` does).
        """
        if self._pieces.sync is not None:   # DiLoCo: a local step, a sync every H
            self._pieces.sync.step(batch_size)
            return
        self._reduction.reduce_for_step()
        self._update.set_scale(batch_size)
        self.optimizer.step()

    def step(self, batch_size=None):
        """:meth:`update` after the reduction that backward started.

        After it ``.grad`` holds the averaged gradient (with ``shard=
        "gradients"``: only on the parts this rank owns).
        """
        self.update(batch_size)

    def close(self):
        """Ends the Trainer on every rank (collective).

        Waits for the reductions backward started (nothing is applied), removes
        the hooks, gives every parameter and gradient its own memory again (the
        current values, no longer views of the store's buffers) and closes
        :attr:`kvstore` if the Trainer made it (a store passed in stays open). The
        model then trains on as any torch model; the Trainer must not be used again.

        The ranks first agree that they all close (a store call, also on a store
        passed in): a rank still training gets, as this one does, a
        :class:`mpikv.MismatchError` such as "rank 1 closed the Trainer after
        step 12 while rank 0 is in step 13: the ranks ran different numbers of
        steps; for uneven data use trainer.join()", and nothing is closed.
        """
        if self._closed:
            return
        if self._resumer is not None:   # a checkpoint due, and those being written
            self._resumer.flush(final=True)
        self._context.collective("Trainer.close", lambda: None, call="close")
        self.kvstore.set_context(None)
        self._closed = True
        if self._resumer is not None:
            self._resumer.stop()
        self._pieces.close(self._owns_store)

    def join(self):
        """Takes part in the other ranks' steps with zero gradients until every rank has joined.

        For uneven data (as :meth:`mpikv.KVStore.join`, and Horovod's
        ``join``): a rank that has run out of batches calls it; until every
        rank has, it adds zeros to each step's gradients, updates the parts it
        owns with the gradient scale and hyperparameters of the ranks still
        training, and gathers the weights, so its model stays equal to
        theirs. Those ranks must only make training steps (``step``, or
        ``allreduce_grads`` and ``update``) until they call ``join``
        themselves. Gradients are averaged over all ranks, joined or not (as
        DDP's ``Join`` does by default). It is the store's join, with this
        rank's part in each step (:class:`.joined.JoinedSteps`) as its ``on_call``.
        When every rank has joined, every rank takes the module's buffers of the
        rank returned (as DDP's join hook broadcasts that rank's model).

        Returns:
            int: the rank that joined last (of ranks that joined at the same
            step, the highest).
        """
        return join(self._pieces)

    def join_like_ddp(self):
        """From now on the buffers come from the highest rank still training, not the
        lowest: DDP's choice once its ``join()`` context is entered (the
        :class:`~mpikv.torch.DistributedDataParallel` wrapper's ``join()`` calls it).
        Every rank calls it at the same point, between steps; it moves nothing."""
        like_ddp(self._pieces)

    def zero_grad(self, set_to_none=None):
        """Zeroes every gradient in place (they stay the store's buffers).

        Args:
            set_to_none: accepted for torch's signature; gradients are never
                set to None (a None gradient would leave the store's buffer).
        """
        del set_to_none
        self._update.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside this block accumulate locally;
        the first backward after it reduces them all, as with DDP's ``no_sync``."""
        previous, self._step.sync = self._step.sync, False
        try:
            yield
        finally:
            self._step.sync = previous

    @property
    def learning_rate(self):
        """The learning rate of the first param group."""
        return self.optimizer.param_groups[0]["lr"]

    def set_learning_rate(self, lr):
        """Sets the learning rate of every param group (as Gluon's Trainer does)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def save_checkpoint(self, path):
        """Saves weights, optimizer state, hyperparameters, scheduler, step count
        and (given a module) rank 0's buffers.

        The store's checkpoint (``path`` and ``path.parts/``, one part per
        owner) holds the weights and the state; ``path.trainer.json`` the rest.
        It loads on any number of ranks. A save is one commit (the store's
        manifest): a save over an earlier one at ``path`` cut short anywhere
        loads as all of one of them (see :mod:`.checkpoint`). Call it between steps; collective (a
        rank that is not in it gets, as the ranks that are, a
        :class:`mpikv.MismatchError` that says where each rank is).
        """
        self._file.refuse_held_state("save_checkpoint")
        self._context.between_steps()
        self._save(path)

    def _save(self, path, background=False):
        """The checkpoint, the current step's reductions (if any) kept going on;
        in the background: returns the store's :class:`~mpikv.state.saves.SaveHandle`."""
        kv = self.kvstore
        self._context.tell("save_checkpoint")
        try:
            return checkpoint.save(kv, path, self._file.meta(), background)
        finally:
            self._context.tell()

    def load_checkpoint(self, path):
        """Restores a :meth:`save_checkpoint` save, on any number of ranks; collective."""
        self._file.refuse_held_state("load_checkpoint")
        self._context.between_steps()
        self._context.tell("load_checkpoint")
        try:
            groups = len(self.optimizer.param_groups)
            self._file.restore(checkpoint.load(self.kvstore, path, groups,
                                               self._file.check))
            self._update.pull_weights()
            if self._sparse is not None:   # the rows, whole, from their owners
                self._sparse.pull_all()
        finally:
            self._context.tell()

    @contextlib.contextmanager
    def gathered(self):
        """Every weight whole in the model inside the block (``shard="parameters"``:
        to read ``model.state_dict()``, say); given back after it. Collective.
        Elsewhere the weights are always whole and it does nothing."""
        if self._shards is None:
            yield
            return
        self._context.settled()
        self._shards.gather_all()
        try:
            yield
        finally:
            self._shards.release_all()

    def resume(self, directory, every=None, *, minutes=None, keep=2, state=None,
               requeue=False, signals=("SIGUSR1", "SIGTERM"), background=True):
        """Continues a run from its newest complete checkpoint, and keeps it going
        through time limits and preemptions; collective, once, before the loop.

        Loads the newest complete checkpoint in ``directory`` on this job's ranks
        (partial and unreadable ones are skipped and removed), saves one every
        ``every`` steps or ``minutes`` minutes (keeping the last ``keep``), and
        turns ``signals`` on: when any rank gets one (SLURM's
        ``--signal=USR1@SECONDS`` warning, a preemption's SIGTERM, ``kill -USR1``),
        every rank saves a complete checkpoint at the next step boundary and
        the job ends with status 75 (``mpikv.torch.resume.EXIT_STATUS``),
        requeued first with ``requeue=True`` under SLURM.

        Args:
            directory: where the checkpoints go (seen by every rank).
            every: save every this many steps; None: only at a signal (or ``minutes``).
            minutes: also save when this many minutes passed since the last save.
            keep: how many complete checkpoints to keep.
            state: the user's own state (the data position, RNG states): an object
                with ``state_dict()`` and ``load_state_dict(d)``; rank 0's is saved
                with each checkpoint and loaded on every rank.
            requeue: ``scontrol requeue $SLURM_JOB_ID`` from rank 0 after the
                checkpoint, at a signal.
            signals: the signals that end the job after a checkpoint.
            background: periodic checkpoints are copied, then written while
                training goes on, and committed at a later step boundary once
                every rank's part is on disk (or at the next checkpoint, at
                ``close()``, or at the end of the process). False: each is
                written before the loop goes on. The one at a signal is always
                written before the job ends.

        Returns:
            int: the step to continue from (``num_update`` of the checkpoint
            loaded), 0 when there is none.
        """
        from .resume import Resumer
        if self._resumer is not None:
            raise errors.InputError("trainer.resume was called already")
        resumer = Resumer(self, self._save, directory, every, minutes, keep, state, requeue,
                          signals, background)
        #: what trainer.run's recovery resumes with, on the survivors' new store
        self._resume_args = (directory, every, dict(minutes=minutes, keep=keep, state=state,
                                                    requeue=requeue, signals=signals,
                                                    background=background))
        step = resumer.start()
        self._resumer = self._reduction.resumer = self._update.resumer = resumer
        self._hooks.before_each_forward(self._flush_resume)   # the next iteration starts
        return step

    def _flush_resume(self):
        self._resumer.flush()

    def __repr__(self):
        return (f"<mpikv.torch.Trainer {len(self._wiring.params)} parameters, "
                f"{len(self._wiring.buckets)} buckets, {self._context.kv!r}>")


__all__ = ["Trainer", "Deferred"]
