"""``python -m benchmarks ...`` from a clone's root: the same as ``python -m mpikv bench ...``."""

import sys

from benchmarks.bench import main

sys.exit(main())
