"""The averaged gradients of 16-bit parameters, whole on every rank (``allreduce_grads``).

A 16-bit parameter's gradient is summed in float32 on its owners (the rule
keeps those sums, see :meth:`mpikv.torch.optimizers.Deferred.owned_parts`).
Gathering puts each owner's parts in a flat float32 vector, zeros elsewhere,
and sums it over the ranks with one store call: exact, since each element has
one nonzero addend.
"""

import numpy as np
import torch

from . import tensors

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
        self._flat = None   # the tensor owned_flat fills (on the first 16-bit parameter's device)

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
            offset = (tensors.address(weight) - tensors.address(p)) // p.element_size()
            yield i, offset, grad.reshape(-1)

    def gather(self, scale):
        """Every 16-bit ``.grad`` becomes the owners' sums times ``scale``, on every rank."""
        self._kv.allreduce_(self.owned_flat(), tag="16-bit gradients")
        flat = self._flat
        tensors.store_before_torch(tensors.device_index(flat))
        with torch.no_grad():
            flat.mul_(scale)
            for i in self._members:
                start = self._offset[i]
                part = flat[start:start + self._params[i].numel()]
                self._grads[i].copy_(part.view(self._params[i].shape))

    def owned_flat(self):
        """This rank's part of :meth:`gather`'s sum: the float32 sums of the parts it
        owns, at their places in one flat vector of every 16-bit parameter, zeros
        elsewhere; a native array (numpy, or cupy on the first 16-bit parameter's
        GPU) that views the tensor :meth:`gather` reads."""
        first = self._params[self._members[0]]
        for device in {tensors.device_index(self._params[i]) for i in self._members}:
            tensors.store_before_torch(device)   # the owners' sums are the store's
        self._flat = flat = torch.zeros(self._total, dtype=torch.float32, device=first.device)
        with torch.no_grad():
            for i, offset, grad in self.owned_parts():
                start = self._offset[i] + offset
                flat[start:start + grad.size].copy_(tensors.from_native(grad))
        tensors.torch_before_store(tensors.device_index(first))
        return tensors.to_native(flat)

    def give_back(self):
        """The owners' parts take ``.grad`` where a script changed it (clipped it)
        since :meth:`gather`; elsewhere their float32 sums, averaged, which
        ``.grad`` holds rounded to 16 bits.

        An element counts as changed when ``.grad`` differs from that rounding:
        the same test on every rank and for any split of the parameters into
        parts, whichever rank's gradients ``.grad`` holds.
        """
        scale = 1.0 / self._kv.num_workers
        with torch.no_grad():
            for i, offset, grad in self.owned_parts():
                averaged = tensors.from_native(grad)   # the owner's sums, in place
                averaged.mul_(np.float32(scale).item())
                given = self._grads[i].reshape(-1)[offset:offset + averaged.numel()]
                kept = given == averaged.to(given.dtype)
                averaged.copy_(torch.where(kept, averaged, given.float()))
                tensors.torch_before_store(tensors.device_index(averaged))


__all__ = ["HALF", "HalfGradients"]
