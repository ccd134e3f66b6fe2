"""A loop of ResNet-50 pushpulls (copying, then zero-copy) to profile, e.g. with py-spy.

    pip install py-spy
    scripts/mpirun.sh -n 2 sh -c '.venv/bin/py-spy record --nonblocking -r 200 -f raw \\
        -o results/spy-$PMIX_RANK.txt -- .venv/bin/python examples/profile_pushpull.py'
"""

import time

import numpy as np

import mpikv
from mpikv.bench import shapes

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
