"""Which runs of a buffer each node owns, and packing them (the index work of a
hierarchical sum to the owners; pure)."""

import numpy as np

from mpikv.reducers import Blocks, even_blocks
from mpikv.transport.spans import copy_runs, node_spans


def test_nodes_by_block_own_one_run_each():
    blocks = even_blocks(10, 4)                       # 2, 3, 2, 3 elements
    assert node_spans(blocks, [[0, 1], [2, 3]]) == [[(0, 5)], [(5, 5)]]


def test_strided_nodes_and_scrambled_blocks_own_several_runs():
    blocks = even_blocks(10, 4)
    assert node_spans(blocks, [[0, 2], [1, 3]]) == [[(0, 2), (5, 2)], [(2, 3), (7, 3)]]
    scrambled = Blocks(blocks.counts[::-1], blocks.displs[::-1])   # rank r: block 3 - r
    assert node_spans(scrambled, [[0, 1], [2, 3]]) == [[(5, 5)], [(0, 5)]]
    # empty blocks own nothing; a node of one rank, nodes of unequal sizes
    assert node_spans(Blocks((0, 1, 1), (0, 0, 1)), [[0, 1], [2]]) == [[(0, 1)], [(1, 1)]]
    assert node_spans(Blocks((0, 0), (0, 0)), [[0], [1]]) == [[], []]


def test_copy_runs_takes_any_window_of_the_runs_end_to_end():
    buf = np.arange(20)
    runs = [(2, 3), (10, 4), (17, 2)]                  # 2 3 4 | 10 11 12 13 | 17 18
    flat = [2, 3, 4, 10, 11, 12, 13, 17, 18]
    for lo in range(len(flat)):
        for size in range(len(flat) - lo + 1):
            out = np.full(size, -1)
            copy_runs(out, buf, runs, lo)
            assert out.tolist() == flat[lo:lo + size], (lo, size)
