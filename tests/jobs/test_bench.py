"""``python -m mpikv bench`` (workloads, ``calls``, ``checkpoint``, ``compression``) end to end.

The figures of two iterations mean nothing; this checks the cases each run
reports and how ``vs baseline`` is computed. The checkpoint run starts the
script itself, ``benchmarks/bench.py``, as a clone's user may.
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
    rc, out, _ = run_job(2, "benchmarks/bench.py", "checkpoint", "--keys", "50", "--keys", "200",
                         "--json", env={"MPIKV_AUTOTUNE": "0"}, timeout=180)
    assert rc == 0, out
    res = json.loads([line for line in out.splitlines() if line.startswith("{")][0])
    assert res["ranks"] == 2 and [r["keys"] for r in res["rows"]] == [50, 200]
    assert all(r["save_s"] > 0 and r["load_s"] > 0 for r in res["rows"])


def _compression(*args):
    rc, out, _ = run_job(2, "-m", "mpikv", "bench", "compression", *args, "--iterations", "2",
                         "--json", env={"MPIKV_AUTOTUNE": "0"}, timeout=180)
    assert rc == 0, out
    return json.loads([line for line in out.splitlines() if line.startswith("{")][0])


def test_compression_reports_bytes_and_time_of_each_case():
    res = _compression("--kib", "64", "--kib", "100")
    assert res["ranks"] == 2 and res["iterations"] == 2 and res["mode"] == "pushpull"
    cases = ["raw", "none", "2bit", "fp16", "bf16"]
    assert [(r["KiB"], r["case"]) for r in res["rows"]] == [(k, c) for k in (64, 100)
                                                           for c in cases]
    for kib in (64, 100):
        rows = {r["case"]: r for r in res["rows"] if r["KiB"] == kib}
        n = kib * 256                      # float32 values
        # What a rank receives, at 2 ranks: an Allreduce's 2 (P-1)/P of the bytes; every
        # other rank's packed codes (n / 4 bytes, in whole words); its half from the
        # other rank and the other half back, both as 16 bits.
        assert rows["raw"]["bytes"] == rows["none"]["bytes"] == 4 * n
        assert rows["2bit"]["bytes"] == -(-n // 16) * 4
        assert rows["fp16"]["bytes"] == rows["bf16"]["bytes"] == 2 * n
        for r in rows.values():
            assert r["push bytes"] == r["bytes"]
            assert r["ms"] > 0
            assert abs(r["time vs none"] - rows["none"]["ms"] / r["ms"]) < 1e-9
            assert abs(r["bytes vs none"] - rows["none"]["bytes"] / r["bytes"]) < 1e-9


def test_compression_with_sgd_moves_codes_to_the_owners_and_float32_back():
    res = _compression("--kib", "64", "--mode", "sgd")
    rows = {r["case"]: r for r in res["rows"]}
    n = 64 * 256                           # one key, not split: one owner takes every sum
    assert res["mode"] == "sgd" and list(rows) == ["raw", "none", "2bit", "fp16", "bf16"]
    # The push: the owner receives the other rank's codes (or 16 bits), while an
    # uncompressed push is an Allreduce; the pull brings the owner's float32 values to
    # the other rank, compressed or not (MXNet's pulls are not compressed).
    assert rows["none"]["push bytes"] == 4 * n
    assert rows["2bit"]["push bytes"] == n // 4
    assert rows["fp16"]["push bytes"] == rows["bf16"]["push bytes"] == 2 * n
    assert rows["2bit"]["bytes"] == rows["fp16"]["bytes"] == 4 * n
    assert rows["none"]["bytes"] == 8 * n
