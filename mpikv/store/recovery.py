"""Going on after a lost rank: a store over the survivors.

A fault-tolerant store that lost a rank raises :class:`mpikv.RankLostError` on
every survivor and is unusable from then on; its collective calls (``close``
included) can no longer be made (:meth:`mpikv.KVStore.abandon` lets it go).
:func:`create_on_survivors` makes the survivors' new store from the error, so
that a caller names no communicator; it is
:func:`mpikv.store.factory.remake_store` (which ``kv.run`` and the Trainer use) for a
store type. See docs/fault-tolerance.md.
"""

from .. import errors


def create_on_survivors(lost, name="dist_sync", **options):
    """A new fault-tolerant store over the survivors of a loss; collective over them.

    Args:
        lost: the :class:`mpikv.RankLostError` every survivor got.
        name: the store type (a ``dist_*`` type).
        **options: :func:`mpikv.store.factory.create`'s other keywords.

    Returns:
        The store; its ranks are the survivors, in their old order.
    """
    if not isinstance(lost, errors.RankLostError) or lost.comm is None:
        raise errors.ValueTypeError(f"create_on_survivors takes the RankLostError the "
                                    f"survivors got, not {type(lost).__name__}")
    from .factory import remake_store
    return remake_store(name, lost, **options)


__all__ = ["create_on_survivors"]
