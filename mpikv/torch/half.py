"""The averaged gradients of 16-bit parameters, whole on every rank (``allreduce_grads``).

A 16-bit parameter's gradient is summed in float32 on its owners (the rule
keeps those sums, see :meth:`mpikv.torch.optimizers.Deferred.owned_parts`).
Gathering puts each owner's parts in a flat float32 vector, zeros elsewhere,
and sums it over the ranks with one store call: exact, since each element has
one nonzero addend.
"""

import numpy as np
import torch

#: the 16-bit dtypes that train on float32 sums
HALF = (torch.float16, torch.bfloat16)


class HalfGradients:
    """The 16-bit parameters' gradients between :meth:`gather` and the update.

    Args:
        kv: the store.
        rule: the store's optimizer (a :class:`~mpikv.torch.optimizers.Deferred`).
        names: every parameter's key, by index.
        params: every parameter, by index.
        grads: every parameter's gradient tensor (its ``.grad``), by index.
    """

    def __init__(self, kv, rule, names, params, grads):
        self._kv, self._rule = kv, rule
        self._params, self._grads = params, grads
        self._index = {name: i for i, name in enumerate(names) if params[i].dtype in HALF}
        self._members = sorted(self._index.values())
        offsets = np.cumsum([0] + [params[i].numel() for i in self._members])
        self._offset = dict(zip(self._members, offsets[:-1].tolist()))
        self._total = int(offsets[-1])

    def __bool__(self):
        return bool(self._members)

    def owned_parts(self):
        """``(parameter index, flat offset, float32 gradient part)`` of each part of a
        16-bit parameter this rank owns."""
        for key, weight, grad, _ in self._rule.owned_parts():
            i = self._index.get(key)
            if i is None:
                continue
            # The part is a view of the parameter's storage: its offset is the distance.
            p = self._params[i]
            offset = (weight.__array_interface__["data"][0] - p.data_ptr()) // p.element_size()
            yield i, offset, grad.reshape(-1)

    def gather(self, scale):
        """Every 16-bit ``.grad`` becomes the owners' sums times ``scale``, on every rank."""
        flat = self.owned_flat()
        self._kv.allreduce_(flat, tag="16-bit gradients")
        flat *= scale
        with torch.no_grad():
            for i in self._members:
                start = self._offset[i]
                part = flat[start:start + self._params[i].numel()]
                self._grads[i].copy_(torch.from_numpy(part).view(self._params[i].shape))

    def owned_flat(self):
        """This rank's part of :meth:`gather`'s sum: the float32 sums of the parts it
        owns, at their places in one flat vector of every 16-bit parameter, zeros
        elsewhere."""
        flat = np.zeros(self._total, np.float32)
        for i, offset, grad in self.owned_parts():
            start = self._offset[i] + offset
            flat[start:start + grad.size] = grad
        return flat

    def give_back(self):
        """The owners' parts take ``.grad`` where a script changed it (clipped it)
        since :meth:`gather`; elsewhere their float32 sums, averaged, which
        ``.grad`` holds rounded to 16 bits.

        An element counts as changed when ``.grad`` differs from that rounding:
        the same test on every rank and for any split of the parameters into
        parts, whichever rank's gradients ``.grad`` holds.
        """
        scale = np.float32(1.0 / self._kv.num_workers)
        with torch.no_grad():
            for i, offset, grad in self.owned_parts():
                grad *= scale
                given = self._grads[i].reshape(-1)[offset:offset + grad.size]
                averaged = torch.from_numpy(grad)
                kept = given == averaged.to(given.dtype)
                grad[...] = torch.where(kept, averaged, given.float()).numpy()


__all__ = ["HALF", "HalfGradients"]
