"""Every strategy's sum to the owners over a real link: tests/mpi/test_reducers.py's
owner cases on 2 network-namespace hosts x 2 ranks (scripts/cluster.sh), TCP
between the hosts and shared memory inside each, so ``hierarchical`` crosses
hosts for real (its leaders' ``Reduce_scatter`` by node, then ``Scatterv``)."""

from .conftest import ROOT
from .test_cluster import cluster  # noqa: F401 (the fixture: down before and after)


def test_reduce_to_owners_on_two_hosts_by_two_ranks(cluster):  # noqa: F811
    cluster("up", "--hosts", "2", "--rate", "10gbit")
    # The timeouts end a hang only: with two 4-rank jobs beside it, 120 s was too few.
    out = cluster("run", "--ranks-per-host", "2", "--timeout", "600", "--", "python", "-m",
                  "pytest", str(ROOT / "tests" / "mpi" / "test_reducers.py"), "-k", "owners",
                  "--with-mpi", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                  "--color=no", timeout=660)
    summaries = [line for line in out.splitlines() if " passed" in line and " in " in line]
    assert len(summaries) == 4, out          # one pytest summary per rank
    assert not any("failed" in line or "error" in line for line in summaries), out
