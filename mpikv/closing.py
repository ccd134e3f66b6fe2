"""``with`` for objects that close collectively."""


class ClosesAfterWith:
    """``with obj:`` calls ``obj.close()`` when the block ends normally.

    After an exception the object is left open: ``close`` is collective, and
    the other ranks may still be in a call, not at the end of their block.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        return False
