"""``python -m mpikv bench`` (workloads and ``calls``) end to end, two short runs.

The figures of two iterations mean nothing; this checks the cases each run
reports and how ``vs baseline`` is computed.
"""

import json

from .conftest import run_job


def _bench(*args):
    rc, out, _ = run_job(2, "-m", "mpikv", "bench", *args, "--iterations", "2", "--json",
                         env={"MPIKV_AUTOTUNE": "0"}, timeout=180)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith(("[{", "{"))]
    assert len(lines) == 1, out
    return json.loads(lines[0])


RAW = ["raw Allreduce in place (one buffer)", "raw Allreduce out of place (one buffer)",
       "raw Allreduce in place, 4 MiB pieces", "raw Reduce+Bcast out of place (one buffer)",
       "raw Allreduce in place per key"]


def test_pushpull_cases_against_the_fastest_raw_way():
    res = _bench("--workload", "small1000", "--mode", "pushpull")[0]
    assert res["ranks"] == 2 and res["iterations"] == 2 and res["library"]
    cases = [r["case"] for r in res["rows"]]
    zero = "mpikv pushpull, zero-copy" + (" (shared memory)" if res["shared_memory"] else "")
    assert cases == RAW + ["mpikv pushpull(keys, grads, out=outs)",
                           "mpikv pushpull(keys, bufs) in place (out=None)",
                           "mpikv pushpull, zero-copy (MPI)", zero,
                           "mpikv Gluon loop: pushpull(i, g[i], out=o[i], priority=-i)"]
    fastest = min(res["rows"][:len(RAW)], key=lambda r: r["ms"])
    assert res["baseline"] == fastest["case"] and fastest["vs baseline"] == 1.0
    for r in res["rows"]:
        assert r["ms"] > 0 and abs(r["vs baseline"] - fastest["ms"] / r["ms"]) < 1e-9


def test_optimizer_mode_baseline_is_the_faster_raw_sum_plus_update():
    res = _bench("--workload", "small1000", "--mode", "sgd")[0]
    cases = [r["case"] for r in res["rows"]]
    with_opt = ["raw Allreduce in place + sgd on every rank",
                "raw Allreduce, 4 MiB pieces + sgd on every rank"]
    assert cases[:len(RAW) + 2] == RAW + with_opt
    assert cases[len(RAW) + 2:][0] == "mpikv push+pull, sgd on owners"
    fastest = min((r for r in res["rows"] if r["case"] in with_opt), key=lambda r: r["ms"])
    assert res["baseline"] == fastest["case"] and fastest["vs baseline"] == 1.0


def test_calls_reports_each_small_call_against_raw():
    res = _bench("calls")
    assert res["ranks"] == 2 and res["iterations"] == 2
    assert [r["case"][:3] for r in res["rows"]] == ["(a)", "(b)", "(c)", "(c)", "(d)"]
    for r in res["rows"]:
        assert r["us"] > 0 and r["raw_us"] > 0
        assert abs(r["vs raw"] - r["raw_us"] / r["us"]) < 1e-9


def test_checkpoint_reports_save_and_load_per_key_count():
    rc, out, _ = run_job(2, "-m", "mpikv", "bench", "checkpoint", "--keys", "50", "--keys", "200",
                         "--json", env={"MPIKV_AUTOTUNE": "0"}, timeout=180)
    assert rc == 0, out
    res = json.loads([line for line in out.splitlines() if line.startswith("{")][0])
    assert res["ranks"] == 2 and [r["keys"] for r in res["rows"]] == [50, 200]
    assert all(r["save_s"] > 0 and r["load_s"] > 0 for r in res["rows"])
