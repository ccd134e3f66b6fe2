"""PyTorch's own distributed tests (torch.testing._internal.distributed.distributed_test,
the class torch runs for gloo, NCCL and MPI) on the "mpikv" backend, under mpikv run.

torch runs that class in processes it forks itself (MultiProcessTestCase), which MPI
cannot take in as ranks; here each MPI rank is one of its processes instead: the
default group is made once (``dist.init_process_group("mpikv")``, as torch's
``_run`` does per test), and each test method named by the patterns runs on every
rank, in the same order, with torch's file barrier between tests. Each rank prints
``TORCHTEST <name> <passed|skipped|failed|excluded> [why]`` lines, then ``TORCHTESTS <counts>``.

    mpikv run -n 2 torch_dist_tests.py TEMP_DIR PATTERN...
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
    os.environ["BACKEND"] = os.environ.get("TORCH_TESTS_AS", "mpikv")
    os.environ["TEMP_DIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "barrier"), exist_ok=True)
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    class OnMPI(DistributedTest._DistTestBase, TestCase):
        pass

    dist.init_process_group("mpikv")
    rank = dist.get_rank()
    names = sorted(n for n in dir(OnMPI) if n.startswith("test_")
                   and any(fnmatch.fnmatchcase(n, p) for p in patterns))
    skips = {s.exit_code: s.message for s in TEST_SKIPS.values()}
    counts = {"passed": 0, "skipped": 0, "failed": 0, "excluded": 0}
    for name in names:
        reason = next((why for p, why in EXCLUDED.items() if fnmatch.fnmatchcase(name, p)), None)
        if reason:
            counts["excluded"] += 1
            print(f"TORCHTEST {name} excluded {reason}", flush=True)
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
        print(f"TORCHTEST {name} {status} {why}".rstrip(), flush=True)
        dist.barrier()
    print(f"TORCHTESTS rank {rank}: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
