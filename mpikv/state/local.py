"""Per-rank state that a layer above keeps in the store's checkpoints.

Some state belongs to one rank and is no owner's: DiLoCo's inner optimizer,
say, whose moments differ from rank to rank. A layer registers it with
:meth:`mpikv.KVStore.add_local_state`; each checkpoint then holds every rank's
arrays in that rank's part (``local.R``, ``R`` the rank, under keys
``NAME/FIELD``), and a load hands each rank its own back, or, on another number
of ranks, those of saved rank ``rank % saved ranks``.
"""

import numpy as np

PREFIX = "local."


class LocalStates:
    """The per-rank states of a store's checkpoints: ``name -> (take, give)``."""

    def __init__(self):
        self._kept = {}

    def add(self, name, take, give):
        """Keeps ``take()``'s arrays in every checkpoint; ``give`` receives them at a load.

        Args:
            name: a str without ``/``, unique on the store.
            take: returns ``{field: numpy array}`` of this rank (called at each save,
                in the calling thread; the arrays are copied).
            give: called after a load, once the ranks agreed, with ``(arrays, same)``:
                the saved ``{field: array}`` (None: the file holds none of ``name``)
                and whether they are this rank's own (False: saved on another number
                of ranks).

        Returns:
            A handle whose ``remove()`` takes the state out of later checkpoints.
        """
        self._kept[name] = (take, give)
        return _Removal(self._kept, name)

    def entries(self, rank):
        """This rank's part file entries (copies)."""
        out = []
        for name, (take, _) in sorted(self._kept.items()):
            for field, array in sorted(take().items()):
                flat = np.array(array).reshape(-1)
                out.append((f"{name}/{field}", f"{PREFIX}{rank}", 0, flat.size,
                            np.shape(array), flat))
        return out

    def wanted(self, man, rank, size):
        """What a load reads for this rank: ``(slices, which saved rank)``."""
        if not self._kept:
            return [], None
        saved = man.meta.get("num_workers") or 1
        source = rank if saved == size else rank % saved
        name = f"{PREFIX}{source}"
        slices = [(key, n, 0, man.array(key, n).size) for key, n in man.arrays()
                  if n == name and key.split("/", 1)[0] in self._kept]
        return slices, saved == size

    def give(self, got, slices, same, man):
        """Hands each state its arrays read at a load."""
        if same is None:
            return
        found = {}
        for key, n, a, b in slices:
            name, field = key.split("/", 1)
            found.setdefault(name, {})[field] = got[(key, n, a, b)].reshape(
                man.array(key, n).shape)
        for name, (_, give) in sorted(self._kept.items()):
            give(found.get(name), same)


class _Removal:
    def __init__(self, kept, name):
        self._kept, self._name = kept, name

    def remove(self):
        """Takes the state out of later checkpoints."""
        self._kept.pop(self._name, None)
