"""mpikv.logs: the rank in every line, the level from MPIKV_LOG_LEVEL, MPI left alone.

``get_logger`` configures process-wide state once, so it is exercised in fresh
interpreters; the pure helpers run here.
"""

import logging
import os
import re
import subprocess
import sys

import pytest

from mpikv import logs as _logging

LAUNCHER_ENV = ("PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE", "MPIKV_LOG_LEVEL")
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} mpikv\[rank (\S+)\] (\w+) (.*)$")


def _log(code, **env):
    """Runs ``code`` in a fresh interpreter; returns its parsed stderr lines and stdout."""
    full = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", "from mpikv.logs import get_logger\n" + code],
                          capture_output=True, text=True, timeout=60, env=full)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    return [m.groups() for m in parsed], proc.stdout


def test_line_carries_rank_and_size_from_the_launcher():
    lines, _ = _log("get_logger().warning('hello')", PMIX_RANK="3", OMPI_COMM_WORLD_SIZE="4")
    assert lines == [("3/4", "WARNING", "hello")]


def test_default_level_is_warning_and_mpi_is_not_initialised():
    code = ("import sys\nlog = get_logger('mpikv.store')\nlog.info('hidden')\n"
            "log.warning('shown')\nprint('mpi4py.MPI' in sys.modules)")
    lines, out = _log(code)
    assert lines == [("-", "WARNING", "shown")]
    assert out.strip() == "False"


@pytest.mark.parametrize("level", ["DEBUG", "debug", "10"])
def test_level_from_the_environment(level):
    lines, _ = _log("get_logger().debug('detail')", MPIKV_LOG_LEVEL=level, PMI_RANK="1")
    assert lines == [("1", "DEBUG", "detail")]


def test_configured_once_and_children_share_the_handler():
    code = ("import logging\nget_logger(); get_logger()\nget_logger('mpikv.x').error('once')\n"
            "print(len(logging.getLogger('mpikv').handlers))")
    lines, out = _log(code)
    assert lines == [("-", "ERROR", "once")]
    assert out.strip() == "1"


def test_rank_comes_from_mpi_once_it_is_initialised():
    # A singleton MPI process: rank 0 of 1, though the environment says otherwise.
    lines, _ = _log("from mpi4py import MPI\nget_logger().warning('up')", PMIX_RANK="7")
    assert lines == [("0/1", "WARNING", "up")]


def test_rank_label_from_the_environment(monkeypatch):
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    assert _logging.rank_label({}) == "-"
    assert _logging.rank_label({"OMPI_COMM_WORLD_RANK": "2"}) == "2"
    assert _logging.rank_label({"PMI_RANK": "5", "PMI_SIZE": "8"}) == "5/8"
    assert _logging.rank_label({"PMIX_RANK": "", "PMI_RANK": "1"}) == "1"


def test_level_from_env_falls_back_to_warning():
    assert _logging.level_from_env({}) == logging.WARNING
    assert _logging.level_from_env({"MPIKV_LOG_LEVEL": "info"}) == logging.INFO
    assert _logging.level_from_env({"MPIKV_LOG_LEVEL": "loud"}) == logging.WARNING
