"""How a store's arguments become calls: read and checked (:mod:`mpikv.calls.reader`),
with the zero-copy route of a repeated push remembered (:mod:`mpikv.store.routes`)."""

from ..calls import reader as calls
from ..calls.reader import CallReader


class Reading:
    """The calls of one store.

    Args:
        engine: its :class:`~mpikv.core.engine.Engine`.
        routes: its protocol's :class:`~mpikv.store.routes.Routes`.
    """

    def __init__(self, engine, routes):
        self._engine, self._routes = engine, routes
        self._reader = CallReader(engine.lookup, lambda: engine.key_type)

    def read(self, op, key, values=None, outs=None, **kw):
        """A :class:`~mpikv.calls.reader.Call` (see :meth:`CallReader.read`)."""
        return self._reader.read(op, key, values, outs, **kw)

    def push(self, op, key, value, priority, out=None):
        """The call of a ``push`` or ``pushpull``: a remembered zero-copy route where
        the same arrays were pushed before, else read and remembered."""
        settings = calls.push_settings(self._engine, priority)
        call = (self._routes.zero_copy_call(op, key, value, settings)
                if out is None and type(priority) is int else None)
        remember = call is None and out is None
        if call is None:
            call = self.read(op, key, value, out, need_values=True,
                             need_outs=op == "pushpull" and out is not None,
                             outs_default_values=op == "pushpull", settings=settings)
        calls.check_push(call, self._engine)
        if remember:
            self._routes.remember_zero_copy(op, key, value, call)
        return call

    def pull(self, key, out, priority):
        """The call of a ``pull``."""
        return self.read("pull", key, outs=out, need_outs=True, settings={"priority": priority})


__all__ = ["Reading"]
