"""The Trainer's pieces, made on one store (at first, and on the survivors' after a loss)."""

import dataclasses
import weakref

from .. import errors
from . import _store, ddp, diloco, param_shards, replicas as _replicas, shard_choice, sparse, tensors
from ._context import StoreContext
from ._files import TrainerFile
from ._module_hooks import ModuleHooks
from ._reduction import GradientReduction, wire_compression
from ._step import StepState
from ._update import OwnerUpdate
from ._wiring import ParamWiring
from .buffers import SharedBuffers
from .half import HALF, HalfGradients
from .hyper import SharedHyperparameters
from .launcher import SettledStore
from .optimizer_face import OwnersOptimizer
from .optimizer_state import ShardedTorchState
from .rule_choice import make_rule
from .status import StepStatus


@dataclasses.dataclass
class Pieces:
    """Every piece of one Trainer on one store (see :func:`make_pieces`)."""

    rule: object
    wiring: ParamWiring
    step: StepState
    context: StoreContext
    reduction: GradientReduction
    update: OwnerUpdate
    hooks: ModuleHooks
    shards: object           # ParameterShards, or None
    sparse: object           # SparseWeights, or None
    buffers: object          # SharedBuffers, or None
    hyper: SharedHyperparameters
    file: TrainerFile
    optimizer: object        # OwnersOptimizer; with sync=DiLoCo, the inner optimizer
    sync: object = None      # the LocalSteps of sync=DiLoCo, or None
    shard: str = "optimizer"   # the shard it runs (chosen here without shard=)
    shard_reason: str = "shard= given"   # why

    def close(self, close_store):
        """Ends the pieces once the ranks agreed to close: hooks off, every weight
        whole in the model's own memory, the launcher ended; the store closed if
        ``close_store``."""
        if self.sync is not None:
            self.sync.remove()
        self.context.close()
        self.hooks.remove()
        if self.shards is not None:   # every weight whole again, for the plain model
            self.shards.gather_all()
            self.shards.remove()
        self.context.launcher.close()
        self.wiring.unwire()
        if close_store:
            self.context.settled().close()

    def let_go(self):
        """Ends what the pieces hold on a lost store, on this rank alone (again:
        nothing more)."""
        if self.sync is not None:
            self.sync.remove()
        self.hooks.remove()
        if self.shards is not None:   # shard="parameters": its hooks
            self.shards.remove()
        try:
            self.context.launcher.close()
        except errors.MPIKVError:
            pass   # its queued calls met the loss too
        self.context.close()
        self.context.kv.abandon()
        self.wiring.unwire(keep_grads=False)   # views of the lost store's buffers


def make_pieces(options, kv, owner):
    """Every piece of a Trainer with :class:`~._options.TrainerOptions` ``options`` on
    the store ``kv``; ``owner``: the Trainer (its collection stops the launcher; the
    pieces hold no reference to it)."""
    made, names, params = options.made, options.names, options.params
    # (the same on every rank: fault tolerance is agreed at creation; one rank has
    # nothing to lose, as a local store ignores fault_tolerant)
    if options.copies and not kv.fault_tolerant and kv.num_workers > 1:
        raise errors.InputError("redundancy='memory' needs a fault-tolerant store "
                                "(fault_tolerant=True)")
    launcher = _store.launcher_for(kv, any(tensors.is_device(p) for p in params))
    weakref.finalize(owner, launcher.stop)   # dropped without close()
    if made["compression"] is not None:
        kv.set_gradient_compression(wire_compression(made["compression"]))
    multi = made["multi_precision"]
    sync = options.sync
    optimizer_class, optimizer_params = made["optimizer"], made["optimizer_params"] or {}
    hyper_groups = options.hyper_groups
    if sync is not None:   # the owners run the outer optimizer; the inner one runs here
        if kv.num_workers > 1:   # every rank in the same mode, or a MismatchError on each
            kv.agree(repr(sync))
        optimizer_class, optimizer_params = sync.outer_optimizer()
        hyper_groups = [{} for _ in hyper_groups]
    rule_args = (optimizer_class, optimizer_params, hyper_groups,
                 names + [n for n, _, _ in options.sparse_named],
                 options.group_of + [g for _, _, g in options.sparse_named],
                 bool(any(p.dtype in HALF for p in params) if multi is None else multi),
                 options.split_parameters)
    rule, groups, defaults = make_rule(*rule_args)
    shard, shard_reason = options.shard, "shard= given"
    why_not = _replicas.refuse(rule, params)
    if shard == "none":   # refused on every rank if on any (a model may differ by rank)
        if why_not is not None:
            kv.fail_next_call(errors.InputError, why_not)
        kv.barrier()
    kv.set_optimizer(rule)
    optimizer = OwnersOptimizer([
        {"params": [p for p, g in zip(params, options.group_of) if g == index], **hyper}
        for index, hyper in enumerate(groups)], defaults)
    if hasattr(rule, "bind"):
        rule.bind(optimizer.param_groups)
    wiring = ParamWiring(kv, names, params, made["bucket_bytes"])
    if options.auto_shard:   # (every rank takes part, even one that cannot replicate)
        chosen, shard_reason = shard_choice.choose(kv, params, optimizer_class,
                                                   optimizer_params, hyper_groups[0],
                                                   wiring, refused=why_not)
        shard = "none" if chosen == "none" else options.shard
    step = StepState(len(params), len(wiring.buckets), rule)
    context = StoreContext(kv, launcher, step, wiring)
    helpers = SettledStore(kv, context.settled)   # the helpers' store: after the launcher
    # Each sparse weight's table: a row table, filled from rank 0's weight.
    sparse_weights = (sparse.SparseWeights(helpers, options.sparse_named, rule,
                                           made["optimizer"])
                      if options.sparse_named else None)
    half = HalfGradients(helpers, rule, names, params, wiring.grads)
    inner = None
    if sync is not None:   # the user's torch class, on this rank's parameters
        inner = made["optimizer"](
            [{"params": [p for p, g in zip(params, options.group_of) if g == index], **hyper}
             for index, hyper in enumerate(options.hyper_groups)],
            **(made["optimizer_params"] or {}))
    lr_scheduler = made["lr_scheduler"]   # (it may add fields, before they are shared)
    lr_scheduler = (lr_scheduler(optimizer if inner is None else inner)
                    if lr_scheduler is not None else None)
    # The hyperparameters as made: the same fields on every rank.
    hyper = SharedHyperparameters(helpers, optimizer.param_groups)
    step.on_reset = context.tell
    step.reset()
    # The module's buffers: shared before each forward, and in checkpoints.
    module = options.module
    buffers = SharedBuffers(helpers, module) if module is not None else None
    hooks = ModuleHooks(helpers, module, buffers, step, options.broadcast_buffers,
                        ddp.wrapper_around(module))
    # Weights on their owners only: gathered around each unit's forward and backward.
    shards = (param_shards.ParameterShards(wiring, context, module, made["units"])
              if options.shard == "parameters" else None)
    reduction = GradientReduction(context, wiring, step, StepStatus(helpers, names), rule,
                                  half, shards, shard in ("optimizer", "none"),
                                  options.error_unused)
    if sync is None:
        file = TrainerFile(step, optimizer, buffers, rule, lr_scheduler)
    else:   # (the inner optimizer's hyperparameters and scheduler)
        file = diloco.SyncedFile(step, inner, buffers, rule, lr_scheduler)
    replicas = None
    if shard == "none":   # a second rule like the owners', for the parts others own
        twin = make_rule(*rule_args)[0]
        twin.bind(optimizer.param_groups)
        replicas = _replicas.Replicas(context, wiring, twin)
    update = (OwnerUpdate if sync is None else diloco.SyncedUpdate)(
        context, reduction, wiring, step, rule, sparse_weights, hyper, shards, options.copies,
        file.meta, optimizer, **({"replicas": replicas} if replicas is not None else {}))
    hooks.watch_gradients(params, reduction.on_grad)
    optimizer.serve(update, context, ShardedTorchState(wiring, rule, context, step, optimizer,
                                                       replicas))
    local = None
    if sync is not None:
        local = diloco.LocalSteps(sync, inner, context, wiring, step, reduction, update, file)
        hooks.before_each_forward(local.before_forward)
    return Pieces(rule, wiring, step, context, reduction, update, hooks, shards,
                  sparse_weights, buffers, hyper, file, optimizer if inner is None else inner,
                  local, shard, shard_reason)


__all__ = ["Pieces", "make_pieces"]
