"""A loop of ResNet-50 pushpulls (copying, then zero-copy) to profile, e.g. with py-spy.

    pip install py-spy
    scripts/mpirun.sh -n 2 sh -c '.venv/bin/py-spy record --nonblocking -r 200 -f raw \\
        -o results/spy-$PMIX_RANK.txt -- .venv/bin/python examples/profile_pushpull.py'
"""

import sys
import time
from pathlib import Path

import numpy as np

import mpikv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's benchmarks/
from benchmarks.common import shapes  # noqa: E402

SECONDS = 8

shp = shapes("resnet50")
keys = list(range(len(shp)))
kv = mpikv.create("dist_sync")
kv.init(keys, [np.zeros(s, np.float32) for s in shp])
grads = [np.ones(s, np.float32) for s in shp]
outs = [np.zeros(s, np.float32) for s in shp]
zero = kv.gradient_buffers(keys)
start = time.time()
while time.time() - start < SECONDS:
    kv.pushpull(keys, grads, out=outs)
    kv.pushpull(keys, zero)
