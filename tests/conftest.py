"""What every test directory shares: the switch that makes a GPU run test the real thing.

``MPIKV_TEST_GPU=1`` (``scripts/gpu-check.sh`` sets it) says the run is on a
machine with a GPU, and that passing must mean the device code ran on it:

* the run stops at once (exit code 3) unless cupy imports, is not the CPU
  stand-in (``tests/fakecupy.py``), and sees a GPU;
* cases parametrized on the stand-in (a parameter value starting with
  ``"stand-in"``: ``tests/unit/test_backends.py``, ``tests/mpi/conftest.py``'s
  ``cp``...) are deselected, so the cases left run on real cupy;
* a test skipped for want of a GPU (a reason that says "no GPU", "cupy not
  installed" or "torch without CUDA") fails instead of passing quietly.

Without the variable nothing changes: the CPU suite runs the stand-in cases
and skips the GPU ones.
"""

import os

import pytest

GPU_ENV = "MPIKV_TEST_GPU"
#: Skip reasons that mean "this machine has no GPU" (a failure under MPIKV_TEST_GPU=1).
NO_GPU_REASONS = ("no GPU", "cupy not installed", "torch without CUDA")


def gpu_required():
    """Whether ``MPIKV_TEST_GPU=1``."""
    return os.environ.get(GPU_ENV, "").strip() == "1"


def pytest_configure(config):
    if not gpu_required():
        return
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no cupy, no driver
        pytest.exit(f"{GPU_ENV}=1 but cupy with a GPU is not there: "
                    f"{type(exc).__name__}: {exc}", returncode=3)
    if getattr(cupy, "STAND_IN", False) or count < 1:
        pytest.exit(f"{GPU_ENV}=1 but cupy is the stand-in or sees no GPU", returncode=3)


def _on_stand_in(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(v, str) and v.startswith("stand-in") for v in params.values())


def pytest_collection_modifyitems(config, items):
    if not gpu_required():
        return
    drop = [item for item in items if _on_stand_in(item)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if not _on_stand_in(item)]


#: set on a test whose setup or call failed on this process (for the fixtures' teardown)
FAILED = pytest.StashKey[bool]()


@pytest.fixture
def make_store(request):
    """``make_store(name="local", **options)``: a store closed at the end of the test,
    unless the test failed (its failure is the report, not a second error from
    ``close``). tests/mpi/conftest.py has the collective one (``dist_sync``, and a
    teardown that cannot hang when one rank failed)."""
    import mpikv
    made = []

    def make(name="local", **options):
        store = mpikv.create(name, **options)
        made.append(store)
        return store

    yield make
    if not request.node.stash.get(FAILED, False):
        for store in reversed(made):
            store.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.stash[FAILED] = True
    if not gpu_required():
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if any(r in reason for r in NO_GPU_REASONS):
            report.outcome = "failed"
            report.longrepr = f"{GPU_ENV}=1, yet skipped for want of a GPU: {reason}"
