"""``RowSparse``: some rows of an array, as MXNet's ``RowSparseNDArray`` holds them."""

import numpy as np

from . import errors


class RowSparse:
    """Rows ``indices`` of an array of ``shape``; ``data[i]`` is row ``indices[i]``.

    Indices may repeat (their rows add up) and come in any order.

    Args:
        indices: 1-D integers, each in ``[0, shape[0])``.
        data: an array of ``(len(indices), *shape[1:])``.
        shape: the whole array's shape.

    Raises:
        ShapeError: the parts do not fit together, or an index is out of range.
        ValueTypeError: the indices are not 1-D integers.
    """

    __slots__ = ("indices", "data", "shape")

    def __init__(self, indices, data, shape):
        shape = tuple(int(d) for d in shape)
        indices = np.asarray(indices)
        data = np.asarray(data)
        if len(shape) < 1:
            raise errors.ShapeError("a RowSparse array has rows: its shape has at least one axis")
        if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
            raise errors.ValueTypeError("RowSparse indices must be a 1-D array of integers")
        if data.shape != (indices.size, *shape[1:]):
            raise errors.ShapeError(f"RowSparse data has shape {data.shape}; {indices.size} rows "
                                    f"of {shape[1:]} make {(indices.size, *shape[1:])}")
        if indices.size and (indices.min() < 0 or indices.max() >= shape[0]):
            raise errors.ShapeError(f"RowSparse indices must lie in [0, {shape[0]}); got "
                                    f"{int(indices.min())}..{int(indices.max())}")
        self.indices = indices.astype(np.int64, copy=False)
        self.data, self.shape = data, shape

    @property
    def dtype(self):
        return self.data.dtype

    def summed(self):
        """The same rows with each index once, in increasing order (repeats added)."""
        unique, inverse = np.unique(self.indices, return_inverse=True)
        if unique.size == self.indices.size:
            order = np.argsort(self.indices, kind="stable")
            return RowSparse(self.indices[order], self.data[order], self.shape)
        data = np.zeros((unique.size, *self.shape[1:]), self.data.dtype)
        np.add.at(data, inverse.reshape(-1), self.data)
        return RowSparse(unique, data, self.shape)

    def todense(self):
        """The whole array: these rows (repeats added), zeros elsewhere."""
        out = np.zeros(self.shape, self.data.dtype)
        np.add.at(out, self.indices, self.data)
        return out

    @classmethod
    def from_torch(cls, tensor):
        """A torch sparse COO tensor's rows (``nn.Embedding(sparse=True)``'s gradient)."""
        t = tensor.coalesce()
        return cls(t.indices()[0].cpu().numpy(), t.values().cpu().numpy(), tuple(t.shape))

    def __repr__(self):
        return f"RowSparse({self.indices.size} rows of {self.shape}, {self.data.dtype})"


__all__ = ["RowSparse"]
