"""``shard="none"``: every rank updates every weight, so no weights travel after a step.

With the default ``shard="optimizer"`` each owner updates its parts and every rank
then gathers the weights: one more allgather of the model per step, 1.5 x the bytes
of DDP's allreduce. Where the link is slow that gather costs more than updating the
whole model on every rank, as DDP does: backward already left the averaged
gradients everywhere. Here each owner still updates its parts with the store's
state (which checkpoints, resharding and buddy copies keep, as in every mode), and
every rank updates the parts it does not own with a replica of their owners' state.
Same parts, same gradients, same weights, same arithmetic: the replicas' results
are the owners', bit for bit, so the ranks' weights stay equal with nothing sent.

A replica is current while it has followed every update since it was copied from
the owners. Whatever replaces the owners' state (a load, a new optimizer) changes
the store's :attr:`mpikv.KVStore.state_generation`; the next step then runs as
``shard="optimizer"`` (owners' update, weights gathered) and copies the owners'
state into the replicas once, in windows of one ``allreduce_`` each (an owner's
bytes and the others' zeros: the owners' bytes, bit for bit).
"""

import numpy as np

from ..arrays import xp as _xp
from .optimizer_state import WINDOW_BYTES


class Replicas:
    """The parts of the weights this rank does not own, with a replica of their state.

    Args:
        context: the :class:`~._context.StoreContext`.
        wiring: the :class:`~._wiring.ParamWiring`.
        rule: a second rule like the owners' (same class, groups and keys), bound to
            the same ``param_groups``: it runs the replicas' arithmetic.
    """

    def __init__(self, context, wiring, rule):
        self._context, self._wiring, self._rule = context, wiring, rule
        self._states = {}          # (key, part start) -> state of a part others own
        self._generation = None    # the store's state_generation the replicas follow

    def current(self, joined_round):
        """Whether this step may update the replicas' parts here instead of gathering
        them (the same answer on every rank); a joined rank's round never does."""
        kv = self._context.settled()
        # (one rank owns every part: nothing to gather, nothing to replicate)
        return not joined_round and (kv.num_workers == 1
                                     or self._generation == kv.state_generation)

    def parts(self):
        """``[(key, start, weight, grad)]`` of the parts others own, in bucket order:
        flat shards of a split key, whole arrays of another's key (as the store hands
        its owners their parts)."""
        rank = self._context.settled().rank
        return [(key, start, weight, grad)
                for key, start, weight, grad, owner in self._all() if owner != rank]

    def held(self):
        """``{key: [(start, stop, state, whole)]}`` of the parts others own, with this
        rank's replica of their state (None where it has not been made), as
        :meth:`mpikv.KVStore.owned_states` gives the owners' own."""
        kv = self._context.settled()
        found = {}
        for key, start, weight, _, owner in self._all():
            if owner != kv.rank:
                found.setdefault(key, []).append((start, start + weight.size,
                                                  self._states.get((key, start)),
                                                  not kv.plan[key].split))
        return found

    def update(self, scale, skip):
        """Updates the parts others own as their owners do, gradients times ``scale``;
        ``skip``: keys no rank gave a gradient (left as they are, state and count too)."""
        rule = self._rule
        for key, start, weight, grad in self.parts():
            state = self._states.get((key, start))
            if state is None:   # (as the owners make theirs, at a first update)
                state = self._states[(key, start)] = rule.create_state(key, weight)
            rule.begin_update(key, weight, grad, state)
        rule.apply(scale, skip=skip)

    def copy_from_owners(self):
        """Makes every replica the owners' state, bit for bit; collective (after a step
        that gathered the weights, so every part's owner holds its state)."""
        kv, rule = self._context.settled(), self._rule
        rule.discard()
        everything = [(key, start, weight) for key, start, weight, _, _ in self._all()]
        owned = {}
        for key, found in kv.owned_states(list(dict.fromkeys(k for k, _, _ in everything))
                                          ).items():
            for p in found.parts:
                owned[(key, p.start)] = p.state
        # Every rank lays out the same buffer: each part's state arrays, in bucket order.
        # An owner that has not made a part's state yet sends the one it will make.
        fresh, segments, total = {}, [], 0
        for key, start, weight in everything:
            made = rule.create_state(key, weight)
            if (key, start) in owned:
                state = owned[(key, start)]
                source = made if state is None else state
            else:
                source, fresh[(key, start)] = None, made
            for name in sorted(made):
                nbytes = made[name].nbytes
                segments.append(((key, start), name, total, nbytes,
                                 None if source is None else source[name]))
                total += -(-nbytes // 8) * 8   # int64 lanes
        for w0 in range(0, total, WINDOW_BYTES):
            w1 = min(total, w0 + WINDOW_BYTES)
            window = np.zeros((w1 - w0) // 8, np.int64)
            raw = window.view(np.uint8)
            for part, name, base, nbytes, source in segments:
                a, b = max(base, w0), min(base + nbytes, w1)
                if a < b and source is not None:
                    raw[a - w0:b - w0] = _host_bytes(source)[a - base:b - base]
            kv.allreduce_(window, tag="optimizer state replicas")
            for part, name, base, nbytes, source in segments:
                a, b = max(base, w0), min(base + nbytes, w1)
                if a < b and part in fresh:
                    _put_bytes(fresh[part][name], a - base, raw[a - w0:b - w0])
        self._states = fresh
        self._generation = kv.state_generation

    def _all(self):
        """``(key, start, weight part, gradient part, owner)`` of every part, owned or
        not, in bucket order."""
        kv, w = self._context.settled(), self._wiring
        plan = kv.plan
        for b, keys in enumerate(w.bucket_keys):
            if w.is_half(b):
                continue
            for key, i, grad in zip(keys, w.buckets[b], w.grad_arrays[b]):
                value, placement = w.value_of(i), plan[key]
                if not placement.split:
                    yield key, 0, value, grad, placement.owner
                    continue
                flat_v, flat_g = value.reshape(-1), grad.reshape(-1)
                for s in placement.shards:
                    yield (key, s.start, flat_v[s.start:s.stop], flat_g[s.start:s.stop],
                           s.owner)

    def forget(self):
        """Drops the replicas (their memory too): the next step gathers the weights."""
        self._states, self._generation = {}, None
        self._rule.discard()

    def nbytes(self):
        """Bytes of replica state this rank holds."""
        return sum(a.nbytes for state in self._states.values() for a in state.values()
                   if hasattr(a, "nbytes"))


def _host_bytes(array):
    """``array``'s bytes on the host, flat."""
    host = array if isinstance(array, np.ndarray) else array.get()
    return np.ascontiguousarray(host).reshape(-1).view(np.uint8)


def _put_bytes(array, offset, data):
    """Writes ``data`` (bytes) into ``array`` from byte ``offset``, wherever it lives."""
    flat = array.reshape(-1).view(np.uint8) if isinstance(array, np.ndarray) else None
    if flat is not None:
        flat[offset:offset + data.size] = data
        return
    host = _host_bytes(array).copy()   # a device array: through the host, once per window
    host[offset:offset + data.size] = data
    with _xp.on(array):
        array[...] = _xp.module_of(array).asarray(host.view(array.dtype).reshape(array.shape))


def refuse(rule, params):
    """Why ``shard="none"`` cannot run with ``rule`` and ``params``, or None.

    Args:
        rule: the owners' rule.
        params: the trained parameters.
    """
    from .half import HALF
    from .optimizers import MXNetRule
    from .sparse import TorchSparseAdam
    if isinstance(rule, MXNetRule):
        return ("shard='none' updates every part on every rank with torch's arithmetic: "
                "pass a torch.optim class, not an mpikv optimizer")
    if isinstance(rule, TorchSparseAdam):
        return "shard='none' needs an optimizer of dense gradients, not SparseAdam"
    if getattr(rule, "whole", False):
        return ("shard='none' needs an elementwise optimizer (its parts may be flat shards: "
                "split_parameters=True)")
    if any(p.dtype in HALF for p in params):
        return ("shard='none' takes no 16-bit parameters (their float32 masters stay on "
                "the owners): use shard='optimizer'")
    return None


__all__ = ["Replicas", "refuse"]
