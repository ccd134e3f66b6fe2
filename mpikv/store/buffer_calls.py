"""A store's zero-copy calls (:meth:`mpikv.KVStore.gradient_buffers`,
:meth:`~mpikv.KVStore.value_buffers`, :meth:`~mpikv.KVStore.gather_gradients`): each
read and checked (:mod:`mpikv.calls.reader`), then agreed and run by the protocol on
the engine's zero-copy buffers (:mod:`mpikv.core.zero_copy`)."""

from ..calls import reader as calls


def _key_list(keys):
    single = not isinstance(keys, (list, tuple))
    return single, [keys] if single else list(keys)


class BufferCalls:
    """The zero-copy calls of one store.

    Args:
        protocol: the store's :class:`~mpikv.store.protocol.Protocol`.
        engine: its :class:`~mpikv.core.engine.Engine`.
        read: its call reader's ``read(op, key, values, outs, **kw)``.
        shared_memory: the store's ``shared_memory`` option.
    """

    def __init__(self, protocol, engine, read, shared_memory):
        self._protocol, self._engine, self._read = protocol, engine, read
        self._shared = shared_memory

    def gradient_buffers(self, keys):
        """Views into the store's buckets, one per key; collective."""
        single, key_list = _key_list(keys)
        call = calls.check_buffers(self._read("gradient_buffers", key_list, settings={
            "shared": self._shared}), self._engine.lookup)
        views = self._protocol.collective(call, lambda: self._engine.gradient_buffers(
            call.keys, self._shared))
        out = [views[k] for k in call.user_keys]
        return out[0] if single else out

    def value_buffers(self, keys):
        """The stored values themselves, one per key; collective."""
        single, key_list = _key_list(keys)
        call = self._read("value_buffers", key_list)
        views = self._protocol.collective(call, lambda: self._engine.value_views(call.keys))
        out = [views[k] for k in call.user_keys]
        return out[0] if single else out

    def gather(self, keys):
        """The owners' sums into every rank's gradient buffers; collective."""
        call = self._gather_call(keys)
        self._protocol.collective(call, lambda: self._engine.gather_grads(call.op, call.keys))

    def gather_async(self, keys):
        """:meth:`gather` in the background; returns the protocol's handle."""
        call = self._gather_call(keys)
        return self._protocol.submit(
            call, action=lambda: self._engine.gather_grads(call.op, call.keys))

    def _gather_call(self, keys):
        return calls.check_gather(self._read("gather_gradients", _key_list(keys)[1]),
                                  self._engine)


__all__ = ["BufferCalls"]
