"""Which rows of a row table an optimizer steps: the pushed ones (lazy) or all."""

import numpy as np
import pytest

from mpikv import optimizer
from mpikv.rows.tables import RowTable, _apply, _lazy
from mpikv.rows.rowsparse import RowSparse


class _Rule:
    """An optimizer that says only whether its kernel is lazy on row-sparse weights."""

    lazy_update = False
    lazy_on_row_sparse_weights = True


@pytest.mark.parametrize("opt, sparse_weight, lazy", [
    (optimizer.SGD(lazy_update=True), False, True),
    (optimizer.SGD(), False, False),
    (optimizer.SGD(), True, False),        # mpikv's SGD has no kernel of its own for them
    (_Rule(), False, False),
    (_Rule(), True, True),
])
def test_lazy_is_the_rules_flag_or_its_kernel_for_row_sparse_weights(opt, sparse_weight, lazy):
    assert _lazy(opt, RowTable((4, 2), np.float64, 0, 1, sparse_weight)) is lazy


@pytest.mark.parametrize("lazy_update", [True, False])
def test_untouched_rows_step_only_without_lazy_update(lazy_update):
    """SGD with weight decay: a row never pushed decays only with the dense semantics."""
    table = RowTable((3, 2), np.float64, 0, 1)
    table.block[...] = 1.0

    class Owners:
        optimizer = optimizer.SGD(learning_rate=0.5, wd=0.2, lazy_update=lazy_update)
        kind = "optimizer"

    _apply("w", table, RowSparse(np.array([1]), np.ones((1, 2)), (3, 2)), Owners)
    np.testing.assert_allclose(table.block[1], 1.0 - 0.5 * (1.0 + 0.2))
    untouched = 1.0 if lazy_update else 1.0 - 0.5 * 0.2
    np.testing.assert_allclose(table.block[[0, 2]], untouched)
