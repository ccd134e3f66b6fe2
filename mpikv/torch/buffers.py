"""A module's buffers (BatchNorm's running statistics) made equal over the ranks.

As DDP's ``broadcast_buffers=True``: before each forward that will be
reduced, every rank takes the buffers of one rank, the first still training
(rank 0 unless it has joined). The buffers travel as bytes in one
``kv.allreduce_`` of ``uint8``: the sending rank's bytes, zeros elsewhere,
so the sum is its bytes exactly, whatever their dtypes. The vector starts
with one byte per rank that says which ranks take part: if the expected
sender has joined since the last step, nobody sent, and a second sum comes
from the first rank still training.
"""

import base64

import numpy as np
import torch

from .. import errors
from . import tensors


#: the tag of the buffer sums (:meth:`mpikv.KVStore.allreduce_`)
TAG = "buffers"


class SharedBuffers:
    """The buffers of a module, sent from one rank to the others.

    Args:
        kv: the store.
        module: the ``torch.nn.Module`` whose buffers are shared (read anew
            at each use: a script may replace a buffer).
    """

    def __init__(self, kv, module):
        self._kv, self._module = kv, module
        self._vector = np.zeros(0, np.uint8)

    def buffers(self):
        """``(name, buffer)`` of every buffer of the module, tied ones once."""
        return list(self._module.named_buffers())

    def __bool__(self):
        return any(True for _ in self._module.buffers())

    def rows(self, sender):
        """This rank's part of the sum: its flag and, if it is ``sender``, its
        buffers' bytes; all zeros for a joined rank (``sender`` None)."""
        buffers = [b for _, b in self.buffers()]
        n = self._kv.num_workers
        total = n + sum(b.numel() * b.element_size() for b in buffers)
        if self._vector.size != total:
            self._vector = np.zeros(total, np.uint8)
        vector = self._vector
        vector[:] = 0
        if sender is None:
            return vector
        rank = self._kv.rank
        vector[rank] = 1
        if rank == sender:
            offset = n
            for b in buffers:
                raw = _bytes(b)
                vector[offset:offset + raw.size] = raw
                offset += raw.size
        return vector

    def take(self, sender, last=False):
        """After the sum: copies ``sender``'s buffers in.

        Returns:
            None, or (``sender`` has joined: nobody sent) the first rank
            taking part (``last``: the last one), which sends in a second sum.
        """
        vector, n = self._vector, self._kv.num_workers
        if not vector[sender]:
            return int(np.flatnonzero(vector[:n])[-1 if last else 0])
        offset = n
        with torch.no_grad():
            for _, b in self.buffers():
                size = b.numel() * b.element_size()
                _set_bytes(b, vector[offset:offset + size])
                offset += size
        return None

    def share(self, sender, last=False):
        """A training rank's part: every rank takes ``sender``'s buffers (or, if
        it has joined, those of the first rank still training; ``last``: of the
        last); collective."""
        self._kv.allreduce_(self.rows(sender), tag=TAG)
        again = self.take(sender, last)
        if again is not None:
            self._kv.allreduce_(self.rows(again), tag=TAG)
            self.take(again)

    # -- checkpoints -------------------------------------------------------
    def to_json(self):
        """This rank's buffers as a JSON-able dict (exact: their bytes)."""
        return {name: {"dtype": str(b.dtype).replace("torch.", ""), "shape": list(b.shape),
                       "bytes": base64.b64encode(_bytes(b).tobytes()).decode("ascii")}
                for name, b in self.buffers()}

    def check_json(self, saved):
        """Why ``saved`` (a :meth:`to_json` dict) does not fit the module, or None."""
        if not isinstance(saved, dict):
            return "its buffers are not a dict"
        mine = dict(self.buffers())
        if set(saved) != set(mine):
            extra, missing = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
            return (f"its buffers do not match the model's"
                    + (f"; not in the model: {', '.join(extra[:3])}" if extra else "")
                    + (f"; not in the checkpoint: {', '.join(missing[:3])}" if missing else ""))
        for name, b in mine.items():
            entry = saved[name]
            want = (str(b.dtype).replace("torch.", ""), list(b.shape))
            if (entry.get("dtype"), entry.get("shape")) != want:
                return (f"buffer {name} is {entry.get('dtype')} {entry.get('shape')} in it, "
                        f"{want[0]} {want[1]} in the model")
        return None

    def load_json(self, saved):
        """Sets every buffer from a :meth:`to_json` dict that :meth:`check_json` accepted."""
        with torch.no_grad():
            for name, b in self.buffers():
                raw = np.frombuffer(base64.b64decode(saved[name]["bytes"]), np.uint8)
                _set_bytes(b, raw)


def _bytes(tensor):
    """A tensor's bytes, as a flat uint8 numpy array (a copy for GPU tensors)."""
    return tensors.host_bytes(tensor)


def _set_bytes(tensor, raw):
    """Writes ``raw`` (a tensor's :func:`_bytes`) into ``tensor``, in place."""
    if tensor.numel() == 0:
        return
    source = tensors.from_host(np.array(raw, np.uint8), tensor)
    tensor.copy_(source.view(tensor.dtype).reshape(tensor.shape))


def refuse_without_module(broadcast_buffers, module):
    """Raises ValueTypeError when buffers are asked for but the Trainer got no module."""
    if broadcast_buffers and module is None:
        raise errors.ValueTypeError(
            "broadcast_buffers=True needs the model itself (Trainer(model, ...)), not its "
            "named_parameters(): the Trainer finds the buffers on the module")


__all__ = ["TAG", "SharedBuffers", "refuse_without_module"]
