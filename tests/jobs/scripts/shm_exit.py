"""Two stores with shared-memory gradient buffers for several key lists, then exit."""

import numpy as np

import mpikv

stores = []
for _ in range(2):
    kv = mpikv.create("dist_sync", timeout=30)
    kv.init([0, 1, 2], [np.zeros(4, np.float32)] * 3)
    for keys in ([0, 1], [2], [1, 2]):
        bufs = kv.gradient_buffers(keys)
        for b in bufs:
            b[:] = 1
        kv.pushpull(keys, bufs)
    stores.append(kv)
print(f"rank {kv.rank}: done", flush=True)
# And one call still running in the background at exit.
h = kv.pushpull_async([0, 1, 2], kv.gradient_buffers([0, 1, 2]))
