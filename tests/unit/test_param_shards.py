"""shard="parameters" without MPI: giving pages back, cutting a model into units, and
the Trainer's checks (the case table runs every level at 1-4 ranks: tests/mpi)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.torch import pages  # noqa: E402
from mpikv.torch.param_shards import plan_units  # noqa: E402
from tests import torch_pieces  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402


# -- pages ------------------------------------------------------------------------------
@pytest.mark.parametrize("ranges", [[(1000, 900_000)], [(0, 3), (5, 7)], [(0, 1_000_000)],
                                    [(4093, 4099), (10, 10)]])
def test_released_ranges_read_zero_and_the_rest_stays(ranges):
    a = np.arange(1_000_000, dtype=np.float32) + 1
    want = a.copy()
    for start, stop in ranges:
        want[start:stop] = 0
    pages.release(a, ranges)
    np.testing.assert_array_equal(a, want)


@pytest.mark.skipif(not pages.AVAILABLE, reason="madvise gives memory back on Linux only")
def test_released_pages_leave_the_resident_memory_and_come_back_when_written():
    a = np.ones(8 << 20, np.float32)   # 32 MiB, all touched
    before = pages.resident_bytes()
    freed = pages.release(a, [(0, a.size)])
    after = pages.resident_bytes()
    assert a.nbytes - pages.PAGE <= freed <= a.nbytes and before - after > 0.9 * a.nbytes
    a[:] = 2.0
    assert pages.resident_bytes() - after > 0.9 * a.nbytes and (a == 2.0).all()


def test_release_takes_flat_contiguous_arrays_only():
    with pytest.raises(ValueError, match="contiguous one-dimensional"):
        pages.release(np.zeros((4, 4))[:, :2], [(0, 1)])


# -- units --------------------------------------------------------------------------------
class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)            # 1600 elements: a leaf, big
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight                 # tied: the root holds it
        self.scale = torch.nn.Parameter(torch.ones(1))       # the root's own


def _plan(model, units=None):
    params = list(dict.fromkeys(model.parameters()))
    index = {id(p): i for i, p in enumerate(params)}
    names = {id(p): n for n, p in model.named_parameters()}
    found, root = plan_units(model, index, [p.numel() * 4 for p in params], units)
    return ([sorted(names[id(params[i])] for i in u.members) for u in found],
            sorted(names[id(params[i])] for i in root.members))


def test_units_are_the_children_cut_by_size_and_shared_parameters_go_to_the_root():
    units, root = _plan(Tower())
    assert units == [[f"blocks.{i}.bias", f"blocks.{i}.weight"] for i in range(4)] + [
        ["norm.bias", "norm.weight"]]
    assert root == ["embed.weight", "scale"]


def test_units_can_be_named():
    model = Tower()
    units, root = _plan(model, units=[model.blocks, model.norm])
    assert units == [sorted(f"blocks.{i}.{w}" for i in range(4) for w in ("bias", "weight")),
                     ["norm.bias", "norm.weight"]]
    assert root == ["embed.weight", "scale"]


# -- the Trainer -----------------------------------------------------------------------------
def test_the_weights_are_whole_only_inside_gathered_and_close_gives_them_back(monkeypatch):
    made = torch_pieces.record(monkeypatch)
    net, ref = cases.Net(), cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, "local", shard="parameters")
    assert len(made[-1].shards.units) >= 4
    with trainer.gathered():
        for (n, a), b in zip(net.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), n
    trainer.close()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))


@pytest.mark.parametrize("kwargs,match", [
    ({"shard": "params"}, "shard must be 'optimizer', 'none', 'gradients' or 'parameters'"),
    ({"units": []}, "units= cuts the model for shard='parameters' only"),
])
def test_bad_sharding_arguments_are_refused(kwargs, match):
    with pytest.raises(mpikv.InputError, match=match):
        mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local", **kwargs)


def test_sharded_parameters_need_the_module_and_host_float_weights():
    net = cases.Net()
    with pytest.raises(mpikv.InputError, match="needs the module"):
        mpikv.torch.Trainer(list(net.named_parameters()), torch.optim.SGD, {"lr": 0.1},
                            "local", shard="parameters", broadcast_buffers=False)
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(mpikv.InputError, match="float32 and float64 parameters only"):
        mpikv.torch.Trainer(half, torch.optim.SGD, {"lr": 0.1}, "local", shard="parameters")
