"""Where values live and how a bucket moves: the Engine and its pieces; no call checks, no MPI."""
