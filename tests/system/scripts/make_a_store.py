"""Makes a dist_sync store and says so (``MADE R/N``): for launches that must refuse."""

import mpikv

kv = mpikv.create("dist_sync", timeout=60)
print(f"MADE {kv.rank}/{kv.num_workers}", flush=True)
kv.close()
