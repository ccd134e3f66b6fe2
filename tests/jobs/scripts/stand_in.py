"""Runs a module with the CPU stand-in of cupy (tests/fakecupy.py) as ``cupy``.

Usage: python tests/jobs/scripts/stand_in.py MODULE [ARGS...]
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests import fakecupy  # noqa: E402

sys.modules.update(fakecupy.build())
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
