"""mpikv/torch/tensors.py is the Trainer's one adapter between torch tensors and native
arrays (so tests/fake_cuda_torch.py can replace it): nothing else in mpikv/torch converts."""

import pathlib
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpikv.torch import tensors  # noqa: E402

TORCH_DIR = pathlib.Path(tensors.__file__).parent
#: conversions and device questions that belong to the adapter
FORBIDDEN = re.compile(r"\.numpy\(\)|from_numpy|from_dlpack|__array_interface__|"
                       r"__cuda_array_interface__|\.is_cuda\b|torch\.cuda|\.cpu\(\)|"
                       r"\.synchronize\(\)")


@pytest.mark.parametrize("path", sorted(p.name for p in TORCH_DIR.glob("*.py")
                                        if p.name != "tensors.py"))
def test_only_the_adapter_converts_tensors(path):
    source = (TORCH_DIR / path).read_text()
    found = [line.strip() for line in source.splitlines()
             if FORBIDDEN.search(line) and not line.strip().startswith("#")]
    assert found == [], f"{path} converts outside mpikv/torch/tensors.py: {found}"


def test_the_adapter_makes_no_host_synchronization_but_the_backends():
    # wait_gpu, the one host wait, is the torch.distributed backend's, on its own
    # thread (or the caller's blocking call); the Trainer never waits on the host.
    source = (TORCH_DIR / "tensors.py").read_text()
    assert source.count(".synchronize(") == 1
    body = source[source.index("def wait_gpu("):]
    assert ".synchronize(" in body[:body.index("\ndef ", 1)]
    callers = [p.name for p in TORCH_DIR.glob("*.py") if "wait_gpu(" in p.read_text()]
    assert sorted(callers) == ["pg_buffers.py", "tensors.py"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
def test_host_tensors_and_numpy_share_memory_both_ways(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    t = torch.arange(6, dtype=getattr(torch, dtype)).reshape(2, 3)
    native = tensors.to_native(t)
    assert isinstance(native, np.ndarray) and native.shape == (2, 3)
    assert tensors.address(native) == tensors.address(t)
    back = tensors.from_native(native)
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
    back[0, 0] = 7
    assert t[0, 0] == 7
    assert not tensors.is_device(t) and tensors.device_index(t) is None
    tensors.torch_before_store(None)   # host tensors: nothing to order
    tensors.store_before_torch(None)
    with tensors.device_scope(None):
        pass


def test_host_copies_and_bytes():
    t = torch.tensor([1.5, -2.0], dtype=torch.float32)
    assert tensors.host_copy(t).tolist() == [1.5, -2.0]
    assert tensors.host_bytes(t).tobytes() == t.numpy().tobytes()
    assert tensors.host_bytes(torch.zeros(0)).size == 0
    assert torch.equal(tensors.from_host(np.array([3.0]), t), torch.tensor([3.0], dtype=torch.float64))
