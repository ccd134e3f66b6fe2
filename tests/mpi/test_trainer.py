"""mpikv.torch.Trainer on 1-4 ranks: every case of tests/trainer_cases.py against
one process with the global batch, DDP's weights, the errors, no hang."""

import pytest

torch = pytest.importorskip("torch")

from tests import trainer_cases as cases  # noqa: E402

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_trainer_equals_one_process_with_the_global_batch(comm, name):
    got = cases.train(name, "dist_sync", comm.rank, comm.size)
    cases.assert_close(got, cases.reference(name, comm.size))
    # Every rank holds the same weights, bit for bit.
    everyone = comm.allgather(got)
    for other in everyone[1:]:
        for n in got:
            assert (other[n] == everyone[0][n]).all(), n
