"""PyTorch's DDP tutorial and its port to mpikv (examples/ddp_tutorial): the port
differs in three lines, and trains to DDP's weights."""

import difflib
import os
import socket
import subprocess
import sys

import pytest

from .conftest import ROOT, run_job

torch = pytest.importorskip("torch")

DDP = ROOT / "examples" / "ddp_tutorial" / "ddp.py"
PORTED = ROOT / "examples" / "ddp_tutorial" / "ported.py"


def _code(path):
    """The file without its docstring (the first triple-quoted block)."""
    text = path.read_text()
    return text.split('"""', 2)[2].splitlines()


def test_the_port_changes_three_lines():
    changed = [line for line in difflib.unified_diff(_code(DDP), _code(PORTED), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == [
        "-from torch.nn.parallel import DistributedDataParallel as DDP",
        "+from mpikv.torch import DistributedDataParallel as DDP, DistributedOptimizer, "
        "init_process_group",
        '-    dist.init_process_group("gloo")',
        '+    init_process_group("gloo")',
        "+    optimizer = DistributedOptimizer(optimizer, model.named_parameters())",
    ]


@pytest.mark.parametrize("n", [3])
def test_the_port_trains_to_ddps_weights(n, tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for _ in range(2):
        proc = subprocess.run(["timeout", "-k", "5", "180", *torchrun, str(DDP),
                               str(tmp_path / "ddp.pt")], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        # The reference is torch's own DDP and gloo, not mpikv: once in a fresh clone's
        # suite one of its ranks aborted ("terminate called without an active
        # exception", SIGABRT). That crash alone is retried, once.
        if "terminate called without an active exception" not in proc.stdout + proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rc, out, _ = run_job(n, str(PORTED), str(tmp_path / "mpikv.pt"), timeout=180)
    assert rc == 0, out
    assert all(f"Start running basic DDP example on rank {r}." in out for r in range(n))
    want = torch.load(tmp_path / "ddp.pt")
    got = torch.load(tmp_path / "mpikv.pt")
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
