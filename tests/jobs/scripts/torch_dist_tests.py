"""PyTorch's own distributed tests (torch.testing._internal.distributed.distributed_test,
the class torch runs for gloo, NCCL and MPI) on the "mpikv" backend, under mpikv run.

torch runs that class in processes it forks itself (MultiProcessTestCase), which MPI
cannot take in as ranks; here each MPI rank is one of its processes instead: the
default group is made once (``dist.init_process_group("mpikv")``, as torch's
``_run`` does per test), and each test method named by the patterns runs on every
rank, in the same order, with torch's file barrier between tests.

torch gates many tests on the backend's name (``BACKEND``, read when its module is
imported): ``TORCH_TESTS_AS`` names the names to run them under, comma-separated
(default "mpikv"), one after the other in this job, the module imported again under
each (importing it costs a rank about 5 s of CPU; a job per name paid it per name).
For each name, each rank prints
``TORCHTEST <as> <name> <passed|skipped|failed|excluded> [why]`` lines, then
``TORCHTESTS <as> rank <r>: <counts>``.

    mpikv run -n 3 torch_dist_tests.py TEMP_DIR PATTERN...
"""

import fnmatch
import os
import re
import sys
import unittest


#: tests that cannot apply to a backend written in Python, with why (their failure also
#: leaves a message unreceived that the next test's recv would take)
EXCLUDED = {
    "test_send_recv_any_source*": "dist.recv(src=None) returns the work's sourceRank(), "
                                  "which a work written in Python cannot give in torch 2.13",
    "test_barrier_timeout*": "gloo's barrier raises on the caller at its timeout; mpikv's "
                             "calls end the job at MPIKV_TIMEOUT, naming the call",
}


def main(temp_dir, patterns):
    import torch.distributed as dist
    dist.init_process_group("mpikv")
    for name in os.environ.get("TORCH_TESTS_AS", "mpikv").split(","):
        run_as(name, os.path.join(temp_dir, name), patterns, dist.get_rank())
        dist.barrier()
    dist.destroy_process_group()


def run_as(backend, temp_dir, patterns, rank):
    """Runs the tests named by ``patterns`` as torch runs them for ``backend``."""
    import importlib

    import torch.distributed as dist
    os.environ["BACKEND"] = backend
    os.environ["TEMP_DIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "barrier"), exist_ok=True)
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed import distributed_test
    # Its decorators read BACKEND once, when the module runs: it runs again per name.
    importlib.reload(distributed_test)

    class OnMPI(distributed_test.DistributedTest._DistTestBase, TestCase):
        pass

    names = sorted(n for n in dir(OnMPI) if n.startswith("test_")
                   and any(fnmatch.fnmatchcase(n, p) for p in patterns))
    skips = {s.exit_code: s.message for s in TEST_SKIPS.values()}
    counts = {"passed": 0, "skipped": 0, "failed": 0, "excluded": 0}
    for name in names:
        reason = next((why for p, why in EXCLUDED.items() if fnmatch.fnmatchcase(name, p)), None)
        if reason:
            counts["excluded"] += 1
            print(f"TORCHTEST {backend} {name} excluded {reason}", flush=True)
            continue
        test = OnMPI(name)
        test.rank = rank
        test.file_name = os.path.join(temp_dir, "init")
        result = unittest.TestResult()
        test.run(result)
        trace = (result.errors + result.failures)[0][1] if result.errors or result.failures else ""
        exit_code = re.search(r"SystemExit: (\d+)", trace)
        if exit_code and int(exit_code.group(1)) in skips:
            # torch's tests skip by exiting with a code of TEST_SKIPS (too few ranks, no GPU)
            status, why = "skipped", skips[int(exit_code.group(1))]
        elif trace:
            status = "failed"
            lines = [ln for ln in trace.strip().splitlines() if ln.strip()
                     and "PYTORCH_PRINT_REPRO" not in ln and not ln.startswith(("To execute", "python "))]
            why = " | ".join(ln.strip() for ln in lines[-3:])[:400]
        elif result.skipped:
            status, why = "skipped", result.skipped[0][1][:120]
        else:
            status, why = "passed", ""
        counts[status] += 1
        print(f"TORCHTEST {backend} {name} {status} {why}".rstrip(), flush=True)
        dist.barrier()
    print(f"TORCHTESTS {backend} rank {rank}: "
          + ", ".join(f"{v} {k}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
