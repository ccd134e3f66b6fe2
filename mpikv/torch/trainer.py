"""The Trainer: a torch model's gradients, optimizer and weights on an mpikv store."""

import contextlib
import weakref

import numpy as np
import torch
from torch.autograd import Variable

from .._closing import ClosesAfterWith
from .. import _xp, errors, recovery
from . import checkpoint
from . import pages, param_shards, sparse, status, syncbn, tensors, torch_rules
from .buffers import SharedBuffers, refuse_without_module
from ._params import backward_buckets, by_precision, named_groups, on_device_of
from .half import HALF as _HALF
from .half import HalfGradients
from .hyper import SharedHyperparameters
from .joined import JoinedSteps
from .launcher import Launcher, SettledStore
from .optimizers import Deferred, MXNetRule
from .rule_choice import make_rule
from .status import StepStatus

#: format tag of the Trainer's part of a checkpoint
CHECKPOINT_FORMAT = checkpoint.FORMAT
#: whether buckets of host parameters go through the launcher's thread too (ResNet-18
#: at 2 ranks on 2 cores was not slower with it: 0.96-1.01 x inline per step)
LAUNCH_HOST_BUCKETS = True


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
            kept on each rank), ``{"type": "fp16"}`` or ``{"type": "bf16"}``.
            float32 parameters only; :meth:`allreduce_grads` gathers the
            owners' sums uncompressed. Default: none.
        shard: what lives on the owners only. ``"optimizer"`` (ZeRO-1; the
            default without compression): the optimizer state; when
            ``backward()`` returns, every ``.grad`` holds the gradient averaged
            over the ranks, as with DDP, so a script may clip, scale or inspect
            it before :meth:`step`. ``"gradients"`` (the default with
            compression): each gradient is also reduced to its owners only (half
            the traffic of an allreduce); ``.grad`` must then not be changed
            between ``backward()`` and :meth:`step` (a :class:`mpikv.GradientError`
            on every rank, nothing applied) and holds the average only where this
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

    Attributes:
        kvstore: the store.
        optimizer: a ``torch.optim.Optimizer`` whose ``param_groups`` hold the
            hyperparameters (torch schedulers change them there); its ``step``
            is :meth:`update`. Its ``state`` stays empty: the state lives on
            the owners.
        lr_scheduler: the scheduler made from ``lr_scheduler``, or None.
        num_update: the number of updates so far.
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore=None, *,
                 bucket_bytes=8 << 20, unused_parameters="zeros", lr_scheduler=None,
                 multi_precision=None, compression=None, shard=None, broadcast_buffers=None,
                 split_parameters=None, module=None, units=None, fault_tolerant=None,
                 min_workers=1, redundancy="checkpoint"):
        if not isinstance(params, (torch.nn.Module, list, tuple)):
            params = list(params)   # (named_parameters(): read again by a recovery)
        #: the arguments it was made with: trainer.run makes it again after a loss
        self._made_with = dict(
            params=params, optimizer=optimizer, optimizer_params=optimizer_params,
            kvstore=kvstore, bucket_bytes=bucket_bytes, unused_parameters=unused_parameters,
            lr_scheduler=lr_scheduler, multi_precision=multi_precision, compression=compression,
            shard=shard, broadcast_buffers=broadcast_buffers, split_parameters=split_parameters,
            module=module, units=units, fault_tolerant=fault_tolerant, min_workers=min_workers,
            redundancy=redundancy)
        if unused_parameters not in ("zeros", "error"):
            raise ValueError(f"unused_parameters must be 'zeros' or 'error', "
                             f"not {unused_parameters!r}")
        if shard is None:
            shard = "optimizer" if compression is None else "gradients"
        if shard not in ("optimizer", "gradients", "parameters"):
            raise errors.InputError(f"shard must be 'optimizer', 'gradients' or 'parameters', "
                                    f"not {shard!r}")
        if units is not None and shard != "parameters":
            raise errors.InputError("units= cuts the model for shard='parameters' only")
        if redundancy not in ("checkpoint", "memory"):
            raise errors.InputError(f"redundancy must be 'checkpoint' or 'memory', "
                                    f"not {redundancy!r}")
        #: backward leaves the averaged gradients in .grad (DDP's guarantee)
        self._averaging = shard == "optimizer"
        self.shard = shard
        named, hyper_groups = named_groups(params)
        if isinstance(params, torch.nn.Module):
            if module is not None and module is not params:
                raise errors.ValueTypeError("module= names the model whose buffers are shared "
                                            "when params are not the module itself")
            module = params
        elif module is not None and not isinstance(module, torch.nn.Module):
            raise errors.ValueTypeError(f"module must be a torch.nn.Module, not "
                                        f"{type(module).__name__}")
        if broadcast_buffers is None:
            broadcast_buffers = module is not None
        refuse_without_module(broadcast_buffers, module)
        # The module's nn.Embedding/EmbeddingBag(sparse=True) weights: rows (.sparse).
        sparse_named = sparse.find(module, named)
        if sparse_named:
            taken = {id(p) for _, p, _ in sparse_named}
            named = [e for e in named if id(e[1]) not in taken]
            sparse.refuse(optimizer, optimizer_params, hyper_groups, sparse_named,
                          [n for n, _, _ in named], shard)
        self._names = [n for n, _, _ in named]
        self._params = [p for _, p, _ in named]
        self._group_of = [g for _, _, g in named]
        # The GPUs of the parameters (none on the host): each stays on its own.
        self._devices = sorted({tensors.device_index(p) for p in self._params
                                if tensors.is_device(p)})
        self._error_unused = unused_parameters == "error"
        if compression is not None:
            _check_compressible(self._names, self._params)
        self._owns_store = kvstore is None or isinstance(kvstore, str)
        #: the owners' parts are flat shards of parameters, else whole parameters
        self.split_parameters = (True if sparse_named and optimizer is torch.optim.SparseAdam
                                 else torch_rules.splits(optimizer, split_parameters))
        if shard == "parameters":
            why = param_shards.refuse(self._params) or (
                None if module is not None else
                "shard='parameters' needs the module (as params, or module=): its "
                "forward and backward gather the weights")
            if why:
                raise errors.InputError(why)
        self._kv = _make_store(kvstore, self._params, compression is not None,
                               whole=not self.split_parameters,
                               private=shard == "parameters", fault_tolerant=fault_tolerant)
        self.min_workers = min_workers
        self._copies = redundancy == "memory"
        # (the same on every rank: fault tolerance is agreed at creation; one rank has
        # nothing to lose, as a local store ignores fault_tolerant)
        if self._copies and not self._kv.fault_tolerant and self._kv.num_workers > 1:
            raise errors.InputError("redundancy='memory' needs a fault-tolerant store "
                                    "(fault_tolerant=True)")
        self._launcher = _launcher_for(self._kv, bool(self._devices))
        # The user's own calls on this store (between backward and step, say) come
        # after the launcher's too.
        self._call_hook = self._kv.add_call_hook(self._settle_for_user)
        weakref.finalize(self, self._launcher.stop)   # dropped without close()
        kv = SettledStore(self._kv, self._settled)   # the helpers' store: after the launcher
        if compression is not None:
            kv.set_gradient_compression(compression)
        self._status = StepStatus(kv, self._names)
        half = any(p.dtype in _HALF for p in self._params)
        if multi_precision is None:
            multi_precision = half
        rule, groups, defaults = make_rule(optimizer, optimizer_params or {}, hyper_groups,
                                           self._names + [n for n, _, _ in sparse_named],
                                           self._group_of + [g for _, _, g in sparse_named],
                                           bool(multi_precision), self.split_parameters)
        self._rule = rule
        kv.set_optimizer(rule)
        self.optimizer = _OwnersOptimizer(self, [
            {"params": [p for p, g in zip(self._params, self._group_of) if g == index], **hyper}
            for index, hyper in enumerate(groups)], defaults)
        if hasattr(rule, "bind"):
            rule.bind(self.optimizer.param_groups)
        self._wire(bucket_bytes)
        # Each sparse weight's table: a row table, filled from rank 0's weight.
        self._sparse = (sparse.SparseWeights(kv, sparse_named, rule, optimizer)
                        if sparse_named else None)
        self._sparse_scale = None
        self._half = HalfGradients(kv, rule, self._names, self._params, self._grads)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.num_update = 0
        self._resumer = None     # trainer.resume's periodic and signalled checkpoints
        self._asked = (False, False, False)
        self._scale = None
        self._joined = 0        # this rank's join ticket, while in join()
        # The hyperparameters as made: the same fields on every rank.
        self._hyper = SharedHyperparameters(kv, self.optimizer.param_groups)
        self._sync = True
        self._start_step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self._params)]
        # The module's buffers: shared before each forward, and in checkpoints.
        self._buffers = SharedBuffers(kv, module) if module is not None else None
        self._module = module
        self._sender = 0   # the rank whose buffers the others take: the first training
        # DDP's rule: a forward shares them when the forward before it (or none)
        # ran with gradients enabled and outside no_sync.
        self._share_next = True
        # torch's SyncBatchNorm sums over torch.distributed: here, over the store.
        self._sync_bn = syncbn.sync_modules(module) if module is not None else []
        syncbn.attach(self._sync_bn, kv)
        # Once, at close() or when a Trainer dropped without it is collected: an open
        # Trainer keeps torch's own SyncBatchNorm from training alone.
        self._detach_sync_bn = weakref.finalize(self, syncbn.detach, self._sync_bn)
        self._forward_hooks = ([module.register_forward_pre_hook(_Hook(self, "_before_forward")),
                                module.register_forward_hook(_Hook(self, "_after_forward"))]
                               if broadcast_buffers and self._buffers else [])
        # Weights on their owners only: gathered around each unit's forward and backward.
        self._shards = (param_shards.ParameterShards(self, module, units)
                        if shard == "parameters" else None)

    @property
    def rank(self):
        """This rank in the Trainer's store (after a loss: among the survivors)."""
        return self._kv.rank

    @property
    def num_workers(self):
        """The number of ranks training (after a loss: the survivors)."""
        return self._kv.num_workers

    def run(self, step_fn, steps, *, min_workers=None):
        """Calls ``step_fn(i)`` for each step ``i``; a lost rank costs the steps since
        the latest checkpoint, not the job. Collective.

        ``step_fn(i)`` makes the ``i + 1``-th update (one :meth:`step`). With
        ``fault_tolerant=True`` and :meth:`resume` (``every=K``), a rank lost in
        any step (a ``kill -9``, a node gone) is, on every survivor alike: a new
        store over the survivors, the Trainer made again on it (``trainer.optimizer``
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
        return run(self, step_fn, steps,
                   self.min_workers if min_workers is None else min_workers)

    def _remake(self, made, lost, older=None):
        """After a lost rank (:mod:`.elastic`, once the lost store was let go): this
        Trainer made again with the arguments ``made`` on a new store over the
        survivors of ``lost``, then resumed from the newest complete checkpoint
        (with buddy copies: first written from them, ``older`` as
        :meth:`mpikv.KVStore.restore_copies` takes it)."""
        directory, every, resume_options = self._resume_args
        lost_store = self._kv
        kvstore, like = made["kvstore"], None
        if kvstore is not None and not isinstance(kvstore, str):
            # a store passed in: one of its type, with its options
            kvstore, like = kvstore.type, kvstore.options
        store = _make_store(kvstore, self._params, made["compression"] is not None,
                            whole=not self.split_parameters, fault_tolerant=True,
                            survivors=lost, options=like)
        try:
            self.__init__(**dict(made, kvstore=store))
        finally:   # (a loss inside __init__: the next recovery needs the first arguments)
            self._made_with = made
        self._owns_store = True
        if self._copies:   # the last step every survivor completed, as a checkpoint
            from .resume import checkpoint_path, write_copy_extra
            store.restore_copies(lost_store, lost, lambda step: checkpoint_path(directory, step),
                                 write_copy_extra, older=older)
        self.resume(directory, every, **resume_options)

    # -- setup -------------------------------------------------------------
    def _wire(self, bucket_bytes):
        """Makes every parameter's storage and gradient views into the store's buffers."""
        kv, params = self.kvstore, self._params
        sizes = [p.numel() * p.element_size() for p in params]
        # A bucket holds 16-bit parameters only, or none: those have no zero-copy
        # gradient buffers (the store sums them in float32); and the parameters of
        # one device only.
        self._buckets = [part for members in backward_buckets(
                             sizes, bucket_bytes, first_bytes=min(bucket_bytes, 1 << 20))
                         for part in by_precision(members, params)]
        self._bucket_of = [0] * len(params)
        self._bucket_device = []
        self._bucket_keys, self._grad_arrays, self._value_arrays = [], [], []
        self._grads = [None] * len(params)
        self._value_views = [None] * len(params)
        for b, members in enumerate(self._buckets):
            for i in members:
                self._bucket_of[i] = b
            keys = [self._names[i] for i in members]
            self._bucket_keys.append(keys)
            device = tensors.device_index(params[members[0]])
            self._bucket_device.append(device)
            # One init per bucket lays the values out as its pushes and pulls move
            # them (nothing is moved later), and frees each parameter's own memory
            # before the next bucket is made: at most one bucket exists twice. The
            # keys live on the parameters' GPU (cupy's current one while made).
            with tensors.device_scope(device):
                tensors.torch_before_store(device)
                kv.init(keys, [tensors.to_native(params[i]) for i in members])
                if params[members[0]].dtype in _HALF:
                    # Pushed from torch's own gradients (copied in, summed in float32).
                    own = [torch.zeros_like(params[i]) for i in members]
                    self._grad_arrays.append([tensors.to_native(g) for g in own])
                else:
                    own = None
                    self._grad_arrays.append(kv.gradient_buffers(keys))
                self._value_arrays.append(kv.value_buffers(keys))
            tensors.store_before_torch(device)
            for k, (i, grad, value) in enumerate(zip(members, self._grad_arrays[b],
                                                     self._value_arrays[b])):
                p = params[i]
                with torch.no_grad():
                    p.data = on_device_of(tensors.from_native(value), p, self._names[i])
                    self._grads[i] = own[k] if own is not None else tensors.from_native(grad)
                self._value_views[i] = value
                p.grad = self._grads[i]

    # -- the step ------------------------------------------------------------
    def _start_step(self):
        n = len(self._params)
        self._touched = [False] * n     # got a gradient since the last reduction
        self._fired = [False] * n       # its hook ran in this (synchronised) backward
        self._versions = [0] * n        # .grad's torch version when its bucket left
        self._cleared = [False] * n     # .grad set to None between backward and step
        self._ready = [0] * len(self._buckets)
        self._launched = [False] * len(self._buckets)
        self._gathered = [False] * len(self._buckets)
        self._queued = False            # the end of this backward averages .grad
        self._next = 0
        self._handles = []
        self._late = []
        self._sent = False      # every bucket's reduction has ended
        self._checked = False   # the status of the step's gradients was summed
        self._scaled = False
        self._joined_round = False   # some rank has joined (known after the status sum)
        self._gathering = False      # the step gathers the gradients (likewise)
        self._unused_everywhere = frozenset()   # keys no rank gave a gradient (likewise)
        self._tell_store()

    def _before_forward(self, module, args):
        """Every rank takes the sender's buffers, after a forward that was reduced."""
        del module, args
        if self._share_next:
            self._buffers.share(self._sender)

    def _after_forward(self, module, args, output):
        del module, args, output
        self._share_next = torch.is_grad_enabled() and self._sync

    def _hook(self, index):
        # The parameter holds its hook for as long as the model lives: a closure over
        # the Trainer would keep a Trainer dropped without close() alive, and with it
        # its launcher thread (weakref.finalize never fired). The hook holds it weakly;
        # once it is gone the hook does nothing and the model trains as a plain one.
        trainer = weakref.ref(self)

        def hook(param):
            self = trainer()
            if self is None:
                return
            if self._shards is not None:   # its unit may give its weights back now
                self._shards.grad_ready(index)
            if self._averaging and self._sent:
                # A second backward before step(): its gradients accumulate on the
                # averaged ones, and the sum is reduced again, as DDP does (a
                # gradient of the first pass only is summed again, not zeroed).
                touched = self._touched
                self._rule.discard()
                self._start_step()
                self._touched = touched
            b = self._bucket_of[index]
            if self._launched[b]:  # its bucket is on the wire: do not touch the buffer
                self._late.append(self._names[index])
                return
            self._rewire(index)
            self._touched[index] = True
            if not self._sync or self._fired[index]:
                return
            self._fired[index] = True
            self._ready[b] += 1
            if self._averaging and not self._queued:
                self._queued = True
                Variable._execution_engine.queue_callback(self.allreduce_grads)
            # Buckets leave in order, so every rank issues the same calls in the same order.
            while (self._next < len(self._buckets)
                   and self._ready[self._next] == len(self._buckets[self._next])):
                self._launch(self._next)
        return hook

    def _wired(self, index):
        """Whether the parameter's ``.grad`` is (a view of) the store's buffer."""
        grad, buf = self._params[index].grad, self._grads[index]
        return grad is buf or (grad is not None and grad.data_ptr() == buf.data_ptr()
                               and grad.shape == buf.shape)

    def _rewire(self, index):
        """Puts a gradient that is no longer the store's buffer back into it.

        Returns:
            bool: whether a gradient of the user's (not the buffer) was copied in.
        """
        p, buf = self._params[index], self._grads[index]
        if self._wired(index):
            if p.grad is not buf:
                p.grad = buf
            return False
        grad = p.grad
        with torch.no_grad():
            if grad is None:
                buf.zero_()
            else:
                buf.copy_(grad)
        p.grad = buf
        return grad is not None

    def _cuda_ready(self):
        """Orders the store's work after torch's queued GPU work, on every GPU of the
        parameters (events: the host does not wait; see :mod:`.tensors`)."""
        for device in self._devices:
            tensors.torch_before_store(device)

    def _store_done(self):
        """Orders torch's later GPU work after the store's (the weights it wrote)."""
        for device in self._devices:
            tensors.store_before_torch(device)

    def _launch(self, b):
        """Queues bucket ``b``'s reduction on the launcher (its agreement is a collective)."""
        # Autograd's thread: no host synchronization, an event orders the push.
        device = self._bucket_device[b]
        tensors.torch_before_store(device)
        self._launched[b] = True
        self._next = b + 1
        for i in self._buckets[b]:
            self._versions[i] = self._grads[i]._version
        kv, keys, arrays = self._kv, self._bucket_keys[b], self._grad_arrays[b]
        handles = self._handles
        # Queued behind its push: the owners' sums reach every rank while backward goes on.
        gather = self._gathered[b] = self._averaging and not self._is_half(b)
        # shard="parameters": once a bucket's sums are on their owners, the rest of its
        # gradients goes at once, while backward goes on (on the launcher's thread:
        # the store runs its calls in order, so waiting there delays nothing after).
        give_back = self._shards is not None and self._launcher.threaded

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
                self._release_gradients(buckets=[b])
        try:
            self._launcher.submit(send)
        except BaseException:   # inline: its agreement failed on every rank
            self._abandon()
            raise

    def _reduce(self, gather=False):
        """Sums every gradient on its owners and checks the step's status."""
        self._send_all()
        self._check(gather)

    def _send_all(self):
        """Ends every bucket's reduction (what backward has not started yet starts now)."""
        if self._sent:
            return
        for i in range(len(self._params)):
            if self._launched[self._bucket_of[i]]:
                # Replaced, or changed in place, after its bucket left.
                if not self._wired(i) or self._grads[i]._version != self._versions[i]:
                    self._late.append(self._names[i])
                continue
            if self._rewire(i):
                self._touched[i] = True  # a gradient assigned by hand counts as one
            if not self._touched[i]:
                self._grads[i].zero_()  # an unused parameter adds zeros
        for b in range(self._next, len(self._buckets)):
            self._launch(b)
        kv = self.kvstore   # (the launcher drained: every handle is in)
        kv.wait(self._handles)
        self._store_done()
        self._handles = []
        self._sent = True
        if self._shards is not None:   # the owners have the sums: the rest goes
            self._release_gradients()

    def _check(self, gather=False):
        """Sums the status of the step's gradients over the ranks, once per step.

        Args:
            gather: the step gathers the gradients (:meth:`allreduce_grads`):
                joined ranks must take part.
        """
        if self._checked:
            return
        self.kvstore.allreduce_(self._status_row(gather), tag=status.TAG)
        self._checked = True
        self._read_status()

    def _status_row(self, gather):
        """This rank's part of the status sum (see :class:`.status.StepStatus`)."""
        stop, save, written = (self._resumer.flags(self.kvstore.rank)
                               if self._resumer is not None else (False, False, False))
        return self._status.row(self._touched, self._cleared, self._late, gather, self._joined,
                                stop, save, written)

    def _read_status(self):
        """Reads the summed status (the same on every rank, joined or not).

        Raises:
            GradientError: gradients were written late, set to None on some
                ranks only, or (``unused_parameters="error"``) left unused, on
                some rank; the step is discarded.
        """
        verdict, error = self._status.read(self._averaging, self._error_unused)
        self._unused_everywhere = verdict.unused_everywhere
        self._joined_round = verdict.joined_round
        self._sender = verdict.sender
        # The same on every rank: from now on until a step with no rank joined.
        self._rule.hyper_agreed = not self._joined_round
        self._gathering = verdict.gathering
        self._asked = (verdict.stop, verdict.save, verdict.written)   # for the resumer
        if error is not None:
            self._rule.discard()
            self._start_step()
            raise error

    def allreduce_grads(self):
        """Averages the gradients over the ranks; every rank then holds them all.

        With the default ``shard="optimizer"`` the end of ``backward()`` does
        it, and a second call does nothing until the next backward. With
        :meth:`update` it splits a step in two, so gradients can be changed in
        between (clipped, say): ``.grad`` holds the average over the ranks,
        whole, on every rank.
        """
        self._queued = False
        if self._scaled:
            return
        self._send_all()
        if not self._averaging:
            # (with shard="optimizer" the status is checked at the step, after the
            # gradients are averaged: see _reduce_for_step and joined.py)
            self._check(gather=True)
        scale = 1.0 / self.kvstore.num_workers
        for b, keys in enumerate(self._bucket_keys):
            if not self._is_half(b) and not self._gathered[b]:
                self.kvstore.gather_gradients(keys)
        self._store_done()
        with torch.no_grad():
            for i, grad in enumerate(self._grads):
                if not self._is_half(self._bucket_of[i]):
                    grad.mul_(scale)
        if self._half:
            self._half.gather(scale)
        self._scaled = True

    def _is_half(self, bucket):
        return self._params[self._buckets[bucket][0]].dtype in _HALF

    def update(self, batch_size=None):
        """The owners update their parts; the weights land back in the parameters.

        Args:
            batch_size: None: gradients are averaged over the ranks (as DDP
                does); else they are summed and divided by ``batch_size`` (as
                Gluon's ``step(batch_size)`` does).
        """
        self._reduce_for_step()
        n = self.kvstore.num_workers
        if batch_size is None:
            scale = 1.0 if self._scaled else 1.0 / n
        else:  # after allreduce_grads the average is turned back into sum / batch_size
            scale = (n if self._scaled else 1.0) / batch_size
        self._scale = scale
        # Sparse gradients are never gathered: each step's rows are summed on the owners.
        self._sparse_scale = 1.0 / (n if batch_size is None else batch_size)
        self.optimizer.step()

    def step(self, batch_size=None):
        """:meth:`update` after the reduction that backward started.

        After it ``.grad`` holds the averaged gradient (with ``shard=
        "gradients"``: only on the parts this rank owns).
        """
        self.update(batch_size)

    def _reduce_for_step(self):
        """The reduction a step needs: with ``shard="optimizer"`` the averaged
        gradients everywhere (if no backward gave them yet: a gradient set by
        hand, or backward inside ``no_sync``), else the owners' sums. Once per
        step (``update`` and ``optimizer.step`` both come here)."""
        if self._checked:
            return
        if self._averaging:
            self.allreduce_grads()
            for i in range(len(self._params)):
                if self._params[i].grad is None:
                    # Set to None since backward (frozen for this step, or a
                    # zero_grad): skipped, as torch's optimizers skip it, if every
                    # rank did so (see _read_status).
                    self._rewire(i)
                    self._touched[i] = False
                    self._cleared[i] = True
                elif self._rewire(i):   # replaced since: the owners take it
                    self._touched[i] = True
            self._check(gather=True)
        else:
            self._reduce()

    def _apply(self):
        """The owners' update and the gathering of the weights (``optimizer.step``)."""
        if self._resumer is not None:
            self._resumer.flush()
        self._reduce_for_step()
        scale = self._scale
        if scale is None:  # optimizer.step() called directly: as update()
            scale = 1.0 if self._scaled else 1.0 / self.kvstore.num_workers
        sparse_scale, self._sparse_scale = self._sparse_scale, None
        if self._sparse is not None:   # checked on every rank before anything changes
            try:
                self._sparse.prepare(self.optimizer.param_groups)
            except BaseException:
                self._rule.discard()
                self._start_step()
                raise
        if self._joined_round:   # the joined ranks take part (see Trainer.join)
            self._hyper.share(scale)
            if self._gathering:
                self._share_gradients()
        self._update_owned(scale)
        self._pull_weights()
        if self._sparse is not None:   # the rows: pushed, updated on the owners, pulled
            self._sparse.apply(sparse_scale if sparse_scale is not None
                               else 1.0 / self.kvstore.num_workers)
        self.num_update += 1
        self._start_step()
        if self._resumer is not None:   # a checkpoint due, or the job's end at a signal
            self._resumer.after_step(*self._asked)   # (made at the next iteration's start)
        if self._copies:
            self._keep_copy()

    def _keep_copy(self):
        """redundancy="memory": this step's owned parts, copied and passed to the
        next rank, with what the Trainer's file and the user's state would hold."""
        state = None if self._resumer is None else self._resumer.user_state()
        self._settled().keep_copy(self.num_update, {"trainer": self._meta(), "user": state})

    def _update_owned(self, scale):
        """The owners' update of the parts they own, gradients times ``scale``."""
        self._store_done()   # torch's update reads the sums, states and weights
        if self._scaled and self._half:
            self._half.give_back()
        if isinstance(self._rule, MXNetRule) and self._rule.inner.lr_scheduler is None:
            self._rule.inner.lr = float(self.optimizer.param_groups[0]["lr"])
        self._rule.apply(scale, skip=self._unused_everywhere)
        self._cuda_ready()
        self._scale = None

    def _first_training_rank(self):
        return self._status.first_training_rank()

    def _share_gradients(self):
        """Every rank takes the first training rank's gradients, as changed (clipped)
        between :meth:`allreduce_grads` and :meth:`update`: joined ranks did not
        change theirs, and they own parts too."""
        sender = self.kvstore.rank == self._first_training_rank()
        self._cuda_ready()
        for bits in self._gradient_bits():
            if not sender:
                with _xp.on(bits):   # on its GPU, whichever is current
                    bits[...] = 0
            self.kvstore.allreduce_(bits, tag="shared gradients")

    def _gradient_bits(self):
        """Every gradient array as integers, in bucket order: summed as integers, one
        rank's bits and zeros give its values, bit for bit."""
        for arrays in self._grad_arrays:
            for grad in arrays:   # native arrays (a 16-bit parameter's: its own gradient's)
                # flat: device arrays are staged through host memory as flat buffers
                yield grad.reshape(-1).view(_BITS[grad.dtype.itemsize])

    def close(self):
        """Ends the Trainer on every rank (collective).

        Waits for the reductions backward started (nothing is applied), removes
        the hooks, gives every parameter and gradient its own memory again (the
        current values, no longer views of the store's buffers) and closes
        :attr:`kvstore` if the Trainer made it (a store passed in stays open). The model then trains on as
        any torch model; the Trainer must not be used again.

        The ranks first agree that they all close (a store call, also on a store
        passed in): a rank still training gets, as this one does, a
        :class:`mpikv.MismatchError` such as "rank 1 closed the Trainer after
        step 12 while rank 0 is in step 13: the ranks ran different numbers of
        steps; for uneven data use trainer.join()", and nothing is closed.
        """
        if self._hooks is None:
            return
        if self._resumer is not None:   # a checkpoint due, and those being written
            self._resumer.flush(final=True)
        self._between_steps()
        self._tell_store("close")
        try:
            self.kvstore.agree("Trainer.close")
        except BaseException:
            self._tell_store()
            raise
        self.kvstore.set_context(None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = None
        if self._resumer is not None:
            self._resumer.stop()
        self._call_hook.remove()
        if self._shards is not None:   # every weight whole again, for the plain model
            self._shards.gather_all()
            self._shards.remove()
        self._launcher.close()
        for hook in self._forward_hooks:
            hook.remove()
        self._detach_sync_bn()
        with torch.no_grad():
            for p, grad in zip(self._params, self._grads):
                p.data = p.data.clone()
                p.grad = grad.clone()
        if self._owns_store:
            self.kvstore.close()

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

        Returns:
            int: the rank that joined last (of ranks that joined at the same
            step, the highest).
        """
        self._between_steps()
        if self._sparse is not None:
            why = ("trainer.join() is not supported with sparse embedding weights (their "
                   "rows are pushed and pulled at each step): give every rank the same "
                   "number of batches")
            self.kvstore.fail_next_call(errors.InputError, why)
            self.kvstore.set_context(f"called trainer.join() after step {self.num_update}", why)
            self.kvstore.barrier()
        if self._shards is not None:
            # The others gather weights unit by unit in their forwards, which a joined
            # rank cannot replay: a call of its own fails, on every rank, with this.
            why = ("trainer.join() is not supported with shard='parameters' (every rank "
                   "must run every step's forward): give every rank the same number of batches")
            self.kvstore.fail_next_call(errors.InputError, why)
            self.kvstore.set_context(f"called trainer.join() after step {self.num_update}", why)
            self.kvstore.barrier()
        self._joined = self.num_update + 1   # nonzero: its status row says "joined"
        self._tell_store("join")   # what the others' errors say of this rank meanwhile
        try:
            # The hyperparameters come with each step (SharedHyperparameters): the
            # store must not replace the rule with a plain optimizer of the others'.
            # (on the parameters' GPU: the replayed calls zero its buffers there)
            with tensors.device_scope(self._devices[0] if len(self._devices) == 1 else None):
                return self.kvstore.join(on_call=JoinedSteps(self), follow_optimizer=False)
        finally:
            self._joined = 0
            self._rule.discard()
            self._start_step()
            # Every rank leaves join() here: the next forward shares the buffers on
            # every rank alike, whatever forwards ran while this rank waited.
            self._share_next = True

    def _pull_weights(self):
        """Every bucket's owners' parts, gathered in place into the parameters
        (with ``shard="parameters"``: each unit's forward gathers its own)."""
        if self._shards is not None:
            self._shards.release_all()
            return
        self.kvstore.wait([self.kvstore.pull_async(keys, out=values)
                           for keys, values in zip(self._bucket_keys, self._value_arrays)])
        self._store_done()

    # -- gradients -------------------------------------------------------------
    def zero_grad(self, set_to_none=None):
        """Zeroes every gradient in place (they stay the store's buffers).

        Args:
            set_to_none: accepted for torch's signature; gradients are never
                set to None (a None gradient would leave the store's buffer).
        """
        del set_to_none
        if self._resumer is not None:   # a checkpoint due after the last step: now
            self._resumer.flush()
        self._between_steps()  # a backward whose step never came: nothing is applied
        if self._shards is not None:   # zeros that cost no memory until written
            self._release_gradients(owned_too=True)
        with torch.no_grad():
            for i, grad in enumerate(self._grads):
                if self._shards is None:
                    grad.zero_()
                if self._params[i].grad is not grad:
                    self._params[i].grad = grad
        if self._sparse is not None:   # as torch's zero_grad(): a sparse gradient is dropped
            self._sparse.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside this block accumulate locally;
        the first backward after it reduces them all, as with DDP's ``no_sync``."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- hyperparameters -------------------------------------------------------
    @property
    def learning_rate(self):
        """The learning rate of the first param group."""
        return self.optimizer.param_groups[0]["lr"]

    def set_learning_rate(self, lr):
        """Sets the learning rate of every param group (as Gluon's Trainer does)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # -- checkpoints -----------------------------------------------------------
    def save_checkpoint(self, path):
        """Saves weights, optimizer state, hyperparameters, scheduler, step count
        and (given a module) rank 0's buffers.

        The store's checkpoint (``path`` and ``path.parts/``, one part per
        owner) holds the weights and the state; ``path.trainer.json`` the rest.
        It loads on any number of ranks. Call it between steps; collective (a
        rank that is not in it gets, as the ranks that are, a
        :class:`mpikv.MismatchError` that says where each rank is).
        """
        self._refuse_held_state("save_checkpoint")
        self._between_steps()
        self._save(path)

    def _save(self, path, background=False):
        """The checkpoint, the current step's reductions (if any) kept going on;
        in the background: returns the store's :class:`~mpikv.saving.SaveHandle`."""
        self._settled()
        self._tell_store("save_checkpoint")
        try:
            return checkpoint.save(self.kvstore, path, self._meta(), background)
        finally:
            self._tell_store()

    def load_checkpoint(self, path):
        """Restores a :meth:`save_checkpoint` save, on any number of ranks; collective."""
        self._refuse_held_state("load_checkpoint")
        self._between_steps()
        self._tell_store("load_checkpoint")
        try:
            meta = checkpoint.load(self.kvstore, path, len(self.optimizer.param_groups),
                                   self._check_buffers)
            for group, saved in zip(self.optimizer.param_groups, meta["param_groups"]):
                group.update({k: tuple(v) if isinstance(v, list) else v
                              for k, v in saved.items()})
            if self.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            self.num_update = int(meta["num_update"])
            if meta.get("buffers") is not None:
                self._buffers.load_json(meta["buffers"])
            self._pull_weights()
            if self._sparse is not None:   # the rows, whole, from their owners
                self._sparse.pull_all()
        finally:
            self._tell_store()

    def _value_of(self, index):
        """The store's value array that parameter ``index`` is a view of."""
        return self._value_views[index]

    def _release_gradients(self, owned_too=False, buckets=None):
        """Gives back the memory of the gradients' parts other ranks own (they read
        zero until backward writes them again); the owned parts too if asked; of
        every bucket, or of ``buckets``.

        Buckets in node shared memory (a store passed in with ``shared_memory``
        on) keep their memory: their parts are zeroed where asked instead.
        """
        plan, rank = self._kv.plan, self._kv.rank
        for b in range(len(self._buckets)) if buckets is None else buckets:
            members = self._buckets[b]
            shared = self._kv.uses_shared_memory(self._bucket_keys[b])
            for i in members:
                grad = self._grads[i]
                if shared:
                    if owned_too:
                        with torch.no_grad():
                            grad.zero_()
                    continue
                pages.release(tensors.to_native(grad).reshape(-1),
                              [(s.start, s.stop) for s in plan[self._names[i]].shards
                               if owned_too or s.owner != rank])

    @contextlib.contextmanager
    def gathered(self):
        """Every weight whole in the model inside the block (``shard="parameters"``:
        to read ``model.state_dict()``, say); given back after it. Collective.
        Elsewhere the weights are always whole and it does nothing."""
        if self._shards is None:
            yield
            return
        self._settled()
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
        resumer = Resumer(self, directory, every, minutes, keep, state, requeue, signals,
                          background)
        #: what trainer.run's recovery resumes with, on the survivors' new store
        self._resume_args = (directory, every, dict(minutes=minutes, keep=keep, state=state,
                                                    requeue=requeue, signals=signals,
                                                    background=background))
        step = resumer.start()
        self._resumer = resumer
        if self._module is not None:   # the next forward starts the next iteration
            self._forward_hooks.append(self._module.register_forward_pre_hook(
                _Hook(self, "_flush_resume")))
        return step

    def _flush_resume(self, module, args):
        del module, args
        self._resumer.flush()

    def _refuse_held_state(self, what):
        """Raises where the owners keep state the store's checkpoint has no place for
        (the rule is the same on every rank: every rank raises)."""
        if getattr(self._rule, "whole", False):
            raise errors.OptimizerError(
                f"trainer.{what}: torch.optim.{self._rule.torch_class.__name__} runs on whole "
                f"parameters, its state kept as torch keeps it; checkpoints of that state are "
                f"not supported yet")

    def _refuse_sparse(self, what):
        """Raises (on every rank: the same model) for torch-format optimizer state of
        sparse weights, which lives in their row tables."""
        if self._sparse is not None:
            raise errors.OptimizerError(
                f"optimizer.{what}: the optimizer state of the sparse embedding weights "
                f"({', '.join(self._sparse.names)}) lives in their row tables on the owners; "
                f"use trainer.save_checkpoint and trainer.load_checkpoint")

    def _check_buffers(self, meta):
        """Why a Trainer file's buffers do not fit this model, or None."""
        saved = meta.get("buffers")
        if saved is None:   # a model without buffers, or a checkpoint from before them
            return None
        if self._buffers is None:
            return ("it holds a module's buffers, but this Trainer was given named "
                    "parameters: pass the model itself")
        return self._buffers.check_json(saved)

    def _collective(self, name, action):
        """Runs ``action``, a collective Trainer call named ``name``, after the ranks
        agree that they all make it: a rank elsewhere (in a step, in ``join``) gets,
        as these do, a MismatchError in the Trainer's terms, nothing done."""
        self._between_steps()
        self._tell_store(name)
        try:
            self.kvstore.agree(name)
            return action()
        finally:
            self._tell_store()

    def _tell_store(self, call=None):
        """Tells the store what this rank is doing (:meth:`mpikv.KVStore.set_context`),
        for the error of a call the ranks make differently: in a step (``call`` None;
        its exit words say after which step the process ended), or in the collective
        method ``call``."""
        n = self.num_update
        after = f"after step {n}" if n else "before its first step"
        steps = "the ranks ran different numbers of steps; for uneven data use trainer.join()"
        if call is None:
            self.kvstore.set_context(f"is in step {n + 1}",
                                     exit=(f"ended its process {after}", steps))
        elif call == "close":
            self.kvstore.set_context(f"closed the Trainer {after}", steps)
        elif call == "join":
            self.kvstore.set_context(
                f"called trainer.join() {after}", "after trainer.join() on some ranks, the "
                "others may only make training steps until they call it too")
        else:
            self.kvstore.set_context(f"called {call} {after}",
                                     f"{call} is collective: every rank must call it")

    def _meta(self):
        hyper = [{k: v for k, v in g.items() if k != "params"}
                 for g in self.optimizer.param_groups]
        # Rank 0 writes the file: its buffers, as a DDP script saving on rank 0.
        saved = self._buffers.to_json() if self._buffers else None
        return {"num_update": self.num_update,
                "param_groups": hyper,
                "buffers": saved,
                "lr_scheduler": (None if self.lr_scheduler is None
                                 else self.lr_scheduler.state_dict())}

    def _between_steps(self):
        """Lets a started step's calls finish and forgets it (nothing is applied)."""
        kv = self.kvstore   # (the launcher drained: every handle is in)
        if self._handles:
            kv.wait(self._handles)
            self._store_done()
        self._rule.discard()
        self._start_step()

    def _settled(self):
        """The store, once the launcher has made every call queued on it: every store
        call of the Trainer and its helpers comes after this (:mod:`.launcher`).

        Raises:
            MPIKVError: a queued call's agreement failed (on every rank alike); the
                step is forgotten, nothing applied.
        """
        try:
            self._launcher.drain()
        except BaseException:
            self._abandon()
            raise
        return self._kv

    kvstore = property(_settled, doc="The store (after the calls backward queued).")

    def _settle_for_user(self):
        """Before any call on the store: the launcher's calls first (not on its own
        thread, whose calls these are)."""
        if not self._launcher.on_thread():
            self._settled()

    def _abandon(self):
        """After a failed reduction call: the calls agreed before it end (they touch
        the buffers), and the step is forgotten."""
        self._kv.wait(self._handles)
        self._store_done()
        self._rule.discard()
        self._start_step()

    def __repr__(self):
        return (f"<mpikv.torch.Trainer {len(self._params)} parameters, "
                f"{len(self._buckets)} buckets, {self._kv!r}>")


class _Hook:
    """A module hook that calls a method of the Trainer. A copy of the module
    (``copy.deepcopy`` for an EMA or best model, pickling) gets a hook that does
    nothing: the copy is not the Trainer's model, and the store cannot be copied."""

    def __init__(self, trainer, method):
        self._trainer, self._method = weakref.ref(trainer), method

    def __call__(self, *args):
        trainer = self._trainer()
        return None if trainer is None else getattr(trainer, self._method)(*args)

    def __deepcopy__(self, memo):
        return _no_hook

    def __reduce__(self):
        return (_NoHook, ())


class _NoHook:
    def __call__(self, *args):
        return None


_no_hook = _NoHook()


class _OwnersOptimizer(torch.optim.Optimizer):
    """The Trainer's torch face: param groups for schedulers; ``step`` is the Trainer's.

    Its ``state`` stays empty: the state lives on the owners, in parts. As with
    torch's ``ZeroRedundancyOptimizer``, :meth:`consolidate_state_dict` gathers
    it onto one rank, where :meth:`state_dict` gives it in the user's torch
    class's format; :meth:`load_state_dict` puts a torch optimizer's state on
    the owners (see :mod:`mpikv.torch.optimizer_state`).
    """

    def __init__(self, trainer, param_groups, defaults):
        from .optimizer_state import ShardedTorchState
        self._trainer = trainer
        self._sharded = ShardedTorchState(trainer)
        # torch's schedulers read defaults (OneCycleLR and CyclicLR look for momentum
        # or betas there), as they would on the user's own optimizer class.
        super().__init__(param_groups, defaults)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._trainer._apply()
        return loss

    def zero_grad(self, set_to_none=True):
        self._trainer.zero_grad()

    def consolidate_state_dict(self, to=0):
        """Gathers the owners' parts of the optimizer state onto rank ``to``; collective.

        Every rank calls it, between steps (a backward whose step has not come
        is dropped, as by ``trainer.save_checkpoint``). Then :meth:`state_dict`
        on rank ``to`` gives the state as torch's own optimizer class would.

        Args:
            to: the rank that receives the state.

        Raises:
            OptimizerError: on every rank, for an mpikv optimizer (its state has
                no torch format: use ``trainer.save_checkpoint``) or a bad ``to``.
        """
        self._trainer._refuse_sparse("consolidate_state_dict")
        self._trainer._collective("consolidate_state_dict",
                                  lambda: self._sharded.consolidate(to))

    def state_dict(self):
        """The state :meth:`consolidate_state_dict` gathered, in torch's format.

        ``{"state": {index: {...}}, "param_groups": [...]}`` as ``state_dict()``
        of the user's torch class over ``param_groups`` gives it (SGD's
        momentum buffers, Adam's ``step``, ``exp_avg`` and ``exp_avg_sq``, NAdam's
        ``mu_product``, ...), shaped as the parameters, on their device; float32
        for 16-bit parameters with float32 masters (``multi_precision``), as for
        a float32 model. Not for classes run on whole parameters (Adafactor).

        Raises:
            OptimizerError: on a rank other than ``to``, before a consolidation,
                after a step since the last one (it would be stale), or for an
                mpikv optimizer.
        """
        return self._sharded.state_dict()

    def load_state_dict(self, state_dict):
        """Puts a torch optimizer's state (a DDP run's, say) on the owners; collective.

        Every rank calls it with the whole dict (``torch.load`` on every rank);
        each owner takes its parts, exactly, and the hyperparameters go into
        ``param_groups``, as torch's ``load_state_dict`` takes them. The
        loaded state replaces the owners' (a parameter without an entry starts
        afresh, as in torch).

        Raises:
            OptimizerError: on every rank, with nothing changed, when some rank's
                dict cannot be mapped (another optimizer's state, other shapes or
                numbers of parameters, a flag the owners do not run), or for an
                mpikv optimizer.
        """
        self._trainer._refuse_sparse("load_state_dict")
        self._trainer._collective("load_state_dict", lambda: self._sharded.load(state_dict))


def _check_compressible(names, params):
    """Raises InputError unless every trained parameter is float32 (the same on every
    rank: the ranks hold the same model)."""
    other = [f"{n} ({str(p.dtype).replace('torch.', '')})"
             for n, p in zip(names, params) if p.dtype != torch.float32]
    if other:
        raise errors.InputError(f"gradient compression takes float32 parameters only (as MXNet's); "
                                f"these are not: {', '.join(other[:5])}"
                                f"{' and more' if len(other) > 5 else ''}")


def _launcher_for(kv, on_gpu):
    """The launcher of a Trainer on ``kv``: a thread only where there are other ranks
    to agree with and MPI takes calls from several threads (THREAD_MULTIPLE);
    elsewhere the calls run inline, on autograd's thread, as the store's own
    asynchronous calls do."""
    threaded = kv.threaded and kv.num_workers > 1 and (on_gpu or LAUNCH_HOST_BUCKETS)
    return Launcher(threaded, kv.options["abort_on_exception"])


def _make_store(kvstore, params, compressed=False, whole=False, private=False,
                fault_tolerant=None, survivors=None, options=None):
    """The Trainer's store: ``kvstore`` if one, else a new one (keys kept whole
    on one owner each where ``whole``; gradient buffers in private memory, whose
    pages can be given back, where ``private``; fault tolerant as asked; over the
    survivors of ``survivors``, a :class:`mpikv.RankLostError`, if given; with the
    :func:`mpikv.create` keywords ``options`` under these)."""
    import mpikv
    if kvstore is not None and not isinstance(kvstore, str):
        if whole and kvstore.num_workers > 1:
            # The plan is the same on every rank: every rank raises alike.
            bound = kvstore.plan.bigarray_bound
            cut = [p for p in params if p.numel() >= bound]
            if cut:
                raise errors.OptimizerError(
                    f"the optimizer runs on whole parameters, and this store splits arrays of "
                    f"{bound} elements or more over its owners ({len(cut)} parameter(s) here): "
                    f"make the store with a larger bigarray_bound, or let the Trainer make it")
        return kvstore
    options = dict(options or {})
    if whole:
        options["bigarray_bound"] = _WHOLE
    if private:
        options["shared_memory"] = False
    if fault_tolerant is not None:
        options["fault_tolerant"] = fault_tolerant
    if survivors is not None:   # no seconds of probing the strategies at each loss
        options["autotune"] = False
    on_gpu = any(tensors.is_device(p) for p in params)
    if kvstore is None:
        name = "dist_sync_device" if on_gpu else "dist_sync"
        kv = (mpikv.create(name, **options) if survivors is None else
              recovery.create_on_survivors(survivors, name, **options))
        # A local store does not compress (MXNet's rule): one rank still gets a dist one.
        if kv.num_workers > 1 or compressed:
            return kv
        kv.close()
        kvstore = "local"
    if on_gpu and "device" not in kvstore:
        kvstore = "device" if kvstore == "local" else "dist_sync_device"
    if survivors is not None and kvstore.startswith("dist"):
        return recovery.create_on_survivors(survivors, kvstore, **options)
    return mpikv.create(kvstore, **options)


#: a bigarray_bound no parameter reaches: every key on one owner
_WHOLE = 1 << 62


#: an integer dtype of each element size, to copy bits through a sum
_BITS = {2: np.int16, 4: np.int32, 8: np.int64}


__all__ = ["Trainer", "Deferred"]
