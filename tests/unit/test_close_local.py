"""close() on a local store: later calls raise, the values handed out stay."""

import numpy as np
import pytest

import mpikv


def test_local_store_close():
    kv = mpikv.create("local")
    kv.init("w", np.ones(3, np.float32))
    values = kv.value_buffers(["w"])
    kv.push("w", np.full(3, 2, np.float32))
    kv.close()
    kv.close()
    assert values[0].tolist() == [2, 2, 2]
    with pytest.raises(mpikv.InputError, match="the store is closed"):
        kv.pull("w", out=np.zeros(3, np.float32))


def test_with_block_closes_only_when_it_ends_normally():
    with pytest.raises(RuntimeError):
        with mpikv.create("local") as kv:
            kv.init(1, np.zeros(2))
            raise RuntimeError("in the block")
    kv.pull(1, out=np.zeros(2))   # left open: the error came from the block
    with kv:
        pass
    with pytest.raises(mpikv.InputError, match="closed"):
        kv.pull(1, out=np.zeros(2))
