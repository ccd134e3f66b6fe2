"""tests/site/sitecustomize.py: the suite's torch processes skip the compiler's import,
and go through torch's own wrappers once something has imported it."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SITE = Path(__file__).resolve().parents[1] / "site"

PROGRAM = """
import sys
import torch

add = torch.optim.Optimizer.add_param_group.__wrapped__
w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
opt = torch.optim.SGD([w], lr=0.5)
print("MADE", "torch._dynamo" in sys.modules, hasattr(add, "__dynamo_disable"))
w.grad = torch.tensor([1.0, -1.0])
opt.step()
print("STEP", w.tolist(), torch.is_grad_enabled())
print("STEPPED", "torch._dynamo" in sys.modules, torch.__version__)
import torch._dynamo
breaks = []
torch._dynamo.graph_break = lambda: breaks.append(1)
opt = torch.optim.SGD([w], lr=0.5)
opt.step()
print("THEN", w.tolist(), hasattr(add, "__dynamo_disable"), len(breaks))
"""


def run(site):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    if site:
        env["PYTHONPATH"] = str(SITE)
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines())


def test_the_compiler_is_imported_only_by_whoever_needs_it():
    shim, plain = run(site=True), run(site=False)
    assert shim["STEP"] == plain["STEP"] == "[0.5, 2.5] True"
    # without the shim the first optimizer imports torch._dynamo and caches its wrapper
    assert plain["MADE"] == "True True" and shim["MADE"] == "False False"
    # the step's wrapper is replaced on torch 2.13 only (it repeats that version's code)
    compiled, version = shim["STEPPED"].split(" ")
    assert compiled == str(not version.startswith("2.13."))
    # once something imports the compiler, torch's own wrappers are used again (the
    # step's breaks the graph before and after)
    assert shim["THEN"] == plain["THEN"] == "[0.0, 3.0] True 2"
