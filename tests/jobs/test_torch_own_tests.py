"""PyTorch's own distributed tests on the "mpikv" backend (issue 42): the collectives'
and DDP's test methods of torch.testing._internal.distributed.distributed_test, the
class torch runs for gloo, NCCL and MPI, at 3 ranks (tests/jobs/scripts/torch_dist_tests.py).

Torch gates many of its tests on the backend's name. They run under three names, one
after the other in one job, the group being mpikv's each time: "mpikv" (what torch
runs for any backend), "gloo" and "mpi" (what it runs for those two on CPUs:
timeouts' tests, CPU all_to_all).
What cannot apply to a backend written in Python is excluded with its reason
(docs/torch.md lists them). None may fail; the numbers that passed are docs/torch.md's.
"""

import os
import re
import sys

import pytest

from .conftest import ROOT, launch

pytest.importorskip("torch")
pytest.importorskip("expecttest")   # torch's test classes need it (the test extra)

SCRIPT = ROOT / "tests" / "jobs" / "scripts" / "torch_dist_tests.py"
PATTERNS = ["test_broadcast*", "test_reduce_*", "test_all_reduce*", "test_all_gather*",
            "test_gather*", "test_scatter*", "test_all_to_all*", "test_barrier*",
            "test_send_recv*", "test_isend*", "test_irecv*", "test_DistributedDataParallel*",
            "test_ddp_*"]
#: per name, tests that must be among those that passed
MUST_PASS = {
    "mpikv": {"test_all_reduce_sum", "test_broadcast", "test_scatter", "test_gather",
              "test_send_recv_with_tag", "test_DistributedDataParallelCPU",
              "test_all_gather_coalesced_simple", "test_all_gather_coalesced_complex"},
    "gloo": {"test_all_reduce_sum_async", "test_all_gather_full_group",
             "test_barrier_full_group"},
    "mpi": {"test_all_to_all_single_unequal_split", "test_all_reduce_group_sum",
            "test_all_to_all_group"},
}


NAMES = ["mpikv", "gloo", "mpi"]


@pytest.fixture(scope="module")
def torch_tests(tmp_path_factory):
    """The output of one job running the tests under each name of NAMES in turn."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MPIKV_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONUNBUFFERED="1", MPIKV_AUTOTUNE="0", MPIKV_TIMEOUT="120",
               TORCH_TESTS_AS=",".join(NAMES))
    rc, out = launch(["timeout", "-k", "5", "900", sys.executable, "-m", "mpikv", "run",
                      "-n", "3", str(SCRIPT), str(tmp_path_factory.mktemp("torch_tests")),
                      *PATTERNS], env)
    assert rc == 0, out
    return out


# ids not "mpi": pytest-mpi takes a test with that keyword for a collective one
@pytest.mark.parametrize("name", NAMES, ids=lambda n: f"named-{n}")
def test_torchs_distributed_tests_pass(torch_tests, name):
    out = torch_tests
    totals = re.findall(rf"^TORCHTESTS {name} rank (\d): (\d+) passed, (\d+) skipped, "
                        r"(\d+) failed, (\d+) excluded$", out, flags=re.M)
    assert sorted(t[0] for t in totals) == ["0", "1", "2"], out
    assert len({t[1:] for t in totals}) == 1, totals   # the same on every rank
    assert all(t[3] == "0" for t in totals), "\n".join(
        line for line in out.splitlines() if " failed " in line)
    passed = set(re.findall(rf"^TORCHTEST {name} (\S+) passed$", out, flags=re.M))
    assert MUST_PASS[name] <= passed, MUST_PASS[name] - passed
