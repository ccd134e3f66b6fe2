"""What a fault-tolerant store costs when nothing fails: pushpull times, with and
without ``fault_tolerant``; docs/fault-tolerance.md has the figures and command.

Usage: ft_cost.py on|off [ELEMENTS] [STEPS]
"""

import sys
import time

import numpy as np

import mpikv


def main(mode, elements=1 << 20, steps=100):
    kv = mpikv.create("dist_sync", fault_tolerant=mode == "on", autotune=False)
    sizes = {"small": 1000, "big": elements}
    kv.init(list(sizes), [np.zeros(n, np.float32) for n in sizes.values()])
    times = {k: [] for k in sizes}
    for _ in range(steps):
        for key, n in sizes.items():
            grad = np.ones(n, np.float32)
            kv.barrier()
            start = time.perf_counter()
            kv.pushpull(key, grad)
            times[key].append(time.perf_counter() - start)
            assert grad[0] == kv.num_workers
    if kv.rank == 0:
        for key, n in sizes.items():
            t = np.median(times[key][steps // 10:])
            print(f"fault_tolerant={mode} ranks={kv.num_workers} {key} ({n} float32): "
                  f"median pushpull {t * 1e3:.3f} ms", flush=True)
    kv.close()


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
