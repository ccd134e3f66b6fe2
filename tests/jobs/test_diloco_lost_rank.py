"""trainer.run with ``sync=DiLoCo``: a lost rank sends the survivors back to the last
sync (its checkpoint), and they end with the weights of one process that simulates
3 ranks up to that sync and 2 after it (tests/jobs/scripts/diloco_train.py)."""

import os
import sys
import uuid

from .conftest import KILL_DETECTOR, MPIRUN, launch
from .test_rank_lost import leftovers

SCRIPT = "tests/jobs/scripts/diloco_train.py"


def test_a_lost_rank_goes_back_to_the_last_sync(tmp_path):
    token = f"mpikv-ft-{uuid.uuid4().hex[:12]}"
    cmd = ["timeout", "-k", "5", "300", str(MPIRUN), "--ft", "-n", "3", sys.executable,
           SCRIPT, str(tmp_path / "ckpt"), token]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_AUTOTUNE="0",
               MPIKV_FT_DETECTOR_TIMEOUT=str(KILL_DETECTOR))
    rc, out = launch(cmd, env)
    assert rc != 124, f"the job hung:\n{out}"
    assert leftovers(token) == [], out
    assert rc in (0, 9), out   # (survivors of a SIGKILL end with status 0)
    assert "Traceback" not in out, out
    assert "rank 2: dying in step 5" in out, out
    assert out.count("trainer.run: lost rank 2 of 3; going on from step 4 on 2 ranks") == 2, out
    for r in (0, 1):
        assert f"rank {r}: finished 12 updates on 2 workers, equal to the reference" in out, out
