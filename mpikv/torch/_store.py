"""The Trainer's store and launcher: made, or taken as given."""

import os

from .. import errors
from ..store import factory
from . import tensors
from .launcher import Launcher

#: whether buckets of host parameters go through the launcher's thread too (ResNet-18
#: at 2 ranks on 2 cores was not slower with it: 0.96-1.01 x inline per step)
LAUNCH_HOST_BUCKETS = True
#: a bigarray_bound no parameter reaches: every key on one owner
WHOLE = 1 << 62
#: the store's bigarray_bound where the Trainer makes it (MPIKV_BIGARRAY_BOUND, or a
#: store passed in, rule instead): parameters of 128 Ki elements or more are cut over
#: the owners, so each bucket's owners' blocks are near-equal. Across a link a bucket's
#: reduce-scatter and allgather take as long as the largest block: at 2 hosts x 1 rank,
#: 1 Gbit/s, ResNet-18's push took 294 ms with 1 Mi (some buckets split 6:3 MB), 204 ms
#: with this, and 186 ms with this and scripts/env.sh's TCP eager limit (the link's
#: bound: 179 ms; docs/performance.md, issue 39).
SPLIT_BOUND = 1 << 17


def launcher_for(kv, on_gpu):
    """The launcher of a Trainer on ``kv``: a thread only where there are other ranks
    to agree with and MPI takes calls from several threads (THREAD_MULTIPLE);
    elsewhere the calls run inline, on autograd's thread, as the store's own
    asynchronous calls do."""
    threaded = kv.threaded and kv.num_workers > 1 and (on_gpu or LAUNCH_HOST_BUCKETS)
    return Launcher(threaded, kv.options["abort_on_exception"])


def make_store(kvstore, params, compressed=False, whole=False, private=False,
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
        options["bigarray_bound"] = WHOLE
    elif "bigarray_bound" not in options and not os.environ.get("MPIKV_BIGARRAY_BOUND"):
        options["bigarray_bound"] = SPLIT_BOUND
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
              factory.remake_store(name, survivors, **options))
        # A local store does not compress (MXNet's rule): one rank still gets a dist one.
        if kv.num_workers > 1 or compressed:
            return kv
        kv.close()
        kvstore = "local"
    if on_gpu and "device" not in kvstore:
        kvstore = "device" if kvstore == "local" else "dist_sync_device"
    if survivors is not None and kvstore.startswith("dist"):
        return factory.remake_store(kvstore, survivors, **options)
    return mpikv.create(kvstore, **options)


def store_for(options, survivors=None):
    """The store of a Trainer with :class:`~._options.TrainerOptions` ``options``;
    over the survivors of ``survivors`` (a RankLostError) after a loss: one of
    the same type and options as a store passed in."""
    made = options.made
    kvstore, like = made["kvstore"], None
    if survivors is not None and kvstore is not None and not isinstance(kvstore, str):
        kvstore, like = kvstore.type, kvstore.options   # a store passed in: its kind
    return make_store(kvstore, options.params, made["compression"] is not None,
                      whole=not options.split_parameters,
                      # (as before: a survivors' store keeps its shared memory)
                      private=options.shard == "parameters" and survivors is None,
                      fault_tolerant=True if survivors is not None else made["fault_tolerant"],
                      survivors=survivors, options=like)


__all__ = ["LAUNCH_HOST_BUCKETS", "WHOLE", "launcher_for", "make_store", "store_for"]
