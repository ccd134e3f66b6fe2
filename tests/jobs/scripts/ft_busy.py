"""Busy ranks under the failure detector: is a live rank ever taken for dead?

Each rank computes about 1.5 s of pure Python (holding the GIL but for its
switches) and 20 numpy matrix products between ``pushpull`` calls, 5 steps;
docs/fault-tolerance.md ("The timeout to use") ran it at several detector
timeouts. Prints ``R ok`` per rank when no rank was lost.

Usage: MPIKV_FT_DETECTOR_TIMEOUT=T scripts/mpirun.sh --ft -n 4 python ft_busy.py
"""

import time

import numpy as np

import mpikv

kv = mpikv.create("dist_sync", fault_tolerant=True, autotune=False, timeout=60)
kv.init("w", np.zeros(10))
for step in range(5):
    end = time.time() + 1.5
    x = 0
    while time.time() < end:
        x += 1
    a = np.random.rand(300, 300)
    for _ in range(20):
        a = a @ a / 300
    g = np.ones(10)
    kv.pushpull("w", g)
    assert g[0] == kv.num_workers
print(kv.rank, "ok", flush=True)
