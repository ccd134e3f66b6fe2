"""The job helper tries a launch again only when the launcher failed before any rank."""

import os

from .conftest import LAUNCH_FAILED, launch


def _script(tmp_path, first, then):
    count = tmp_path / "count"
    return ["sh", "-c", f'n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}; '
                        f'if [ "$n" = 0 ]; then {first}; else {then}; fi'], count


def test_a_launch_that_never_started_is_tried_again(tmp_path):
    cmd, count = _script(tmp_path, f"echo \"{LAUNCH_FAILED}\"; exit 213", "echo ran; exit 0")
    rc, out = launch(cmd, dict(os.environ))
    assert rc == 0 and count.read_text().strip() == "2"
    assert out.startswith("[launch failed before any rank started; tried again]") and "ran" in out


def test_other_failures_are_not_tried_again(tmp_path):
    cmd, count = _script(tmp_path, "echo broken; exit 1", "exit 0")
    rc, out = launch(cmd, dict(os.environ))
    assert (rc, out.strip(), count.read_text().strip()) == (1, "broken", "1")
