"""The Trainer's store as its calls see it: after the launcher's, in the Trainer's words."""


class StoreContext:
    """The store behind the Trainer's launcher, and what the Trainer tells it.

    Every store call of the Trainer and its helpers comes after the launcher's
    queued calls (:meth:`settled`); the user's own calls do too, through the
    store's call hook. Each rank tells the store what it is doing
    (:meth:`tell`), for the error of a call the ranks make differently.

    Args:
        kv: the store.
        launcher: the Trainer's :class:`~.launcher.Launcher`.
        step: the Trainer's :class:`~._step.StepState`.
        wiring: the Trainer's :class:`~._wiring.ParamWiring`.

    Attributes:
        kv: the store, as is (for the launcher's own thread).
        launcher: the launcher.
    """

    def __init__(self, kv, launcher, step, wiring):
        self.kv, self.launcher = kv, launcher
        self._step, self._wiring = step, wiring
        # The user's own calls on this store (between backward and step, say) come
        # after the launcher's too.
        self._call_hook = kv.add_call_hook(self.settle_for_user)

    def settled(self):
        """The store, once the launcher has made every call queued on it.

        Raises:
            MPIKVError: a queued call's agreement failed (on every rank alike); the
                step is forgotten, nothing applied.
        """
        try:
            self.launcher.drain()
        except BaseException:
            self.abandon()
            raise
        return self.kv

    def settle_for_user(self):
        """Before any call on the store: the launcher's calls first (not on its own
        thread, whose calls these are)."""
        if not self.launcher.on_thread():
            self.settled()

    def abandon(self):
        """After a failed reduction call: the calls agreed before it end (they touch
        the buffers), and the step is forgotten."""
        self.kv.wait(self._step.handles)
        self._wiring.store_done()
        self._step.discard()

    def between_steps(self):
        """Lets a started step's calls finish and forgets it (nothing is applied)."""
        kv = self.settled()   # (the launcher drained: every handle is in)
        if self._step.handles:
            kv.wait(self._step.handles)
            self._wiring.store_done()
        self._step.discard()

    def collective(self, name, action, call=None):
        """Runs ``action``, a collective Trainer call named ``name``, after the ranks
        agree that they all make it: a rank elsewhere (in a step, in ``join``) gets,
        as these do, a MismatchError in the Trainer's terms (:meth:`tell` of ``call``,
        default ``name``), nothing done."""
        self.between_steps()
        self.tell(name if call is None else call)
        try:
            self.settled().agree(name)
            return action()
        finally:
            self.tell()

    def tell(self, call=None):
        """Tells the store what this rank is doing (:meth:`mpikv.KVStore.set_context`),
        for the error of a call the ranks make differently: in a step (``call`` None;
        its exit words say after which step the process ended), in a second backward
        of the step (``call`` "backward"), or in the collective method ``call``."""
        n = self._step.num_update
        after = f"after step {n}" if n else "before its first step"
        steps = "the ranks ran different numbers of steps; for uneven data use trainer.join()"
        kv = self.settled()
        if call is None:
            kv.set_context(f"is in step {n + 1}", exit=(f"ended its process {after}", steps))
        elif call == "close":
            kv.set_context(f"closed the Trainer {after}", steps)
        elif call == "backward":
            kv.set_context(
                f"ran backward a second time in step {n + 1}", "a second backward before "
                "step() reduces the gradients again, as DDP's does: every rank must run it "
                "(to accumulate without reducing, use trainer.no_sync())")
        elif call == "join":
            kv.set_context(
                f"called trainer.join() {after}", "after trainer.join() on some ranks, the "
                "others may only make training steps until they call it too")
        else:
            kv.set_context(f"called {call} {after}",
                           f"{call} is collective: every rank must call it")

    def refuse(self, exc_class, why, activity):
        """Fails on every rank, in the next call (a barrier), with ``why``: this rank's
        check failed (the others' calls fail alike, with this rank's context)."""
        self.settled().refuse(exc_class, why, activity)

    def close(self):
        """Stops settling the user's calls (the Trainer is closing, or let go)."""
        self._call_hook.remove()


__all__ = ["StoreContext"]
