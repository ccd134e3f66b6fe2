"""Going on after a lost rank: a store over the survivors, the lost store let go.

A fault-tolerant store that lost a rank raises :class:`mpikv.RankLostError` on
every survivor and is unusable from then on; its collective calls (``close``
included) can no longer be made. These helpers are what a survivor does next,
the same on every survivor: let the old store go without a collective call
(:func:`abandon`), and make a new store over the survivors
(:func:`create_on_survivors`). Callers above the store (the Trainer) use them
so as to name no communicator. See docs/fault-tolerance.md.
"""

from . import errors


def create_on_survivors(lost, name="dist_sync", **options):
    """A new fault-tolerant store over the survivors of a loss; collective over them.

    Args:
        lost: the :class:`mpikv.RankLostError` every survivor got.
        name: the store type (a ``dist_*`` type).
        **options: :func:`mpikv.kvstore.create`'s other keywords.

    Returns:
        The store; its ranks are the survivors, in their old order.
    """
    if not isinstance(lost, errors.RankLostError) or lost.comm is None:
        raise errors.ValueTypeError(f"create_on_survivors takes the RankLostError the "
                                    f"survivors got, not {type(lost).__name__}")
    from .kvstore import create
    options["fault_tolerant"] = True
    return create(name, comm=lost.comm, **options)


def abandon(kv):
    """Lets a store that lost a rank go, on this rank alone (no collective call).

    Its background checkpoint writes end and are never committed: a checkpoint
    is visible only once committed (:mod:`mpikv.saving`), so none is left
    half-written in its place. Its worker thread is left (a daemon: it has
    nothing more to do).
    """
    for handle in getattr(kv, "_saves", ()):
        handle.abandon()
    if hasattr(kv, "_saves"):
        kv._saves.clear()


__all__ = ["abandon", "create_on_survivors"]
