"""The README and the user guide in docs/: links resolve, runnable examples run.

No MPI launcher: a runnable block runs under the test's own Python, where a
``dist_sync`` store has one rank (mpi4py's singleton start).

A block is runnable when the line right before its ```` ```python ```` fence is
``<!-- runnable -->``, or ``<!-- runnable: needs torch, ml_dtypes -->`` for a
block that needs modules which may be missing (then it is skipped, saying
which, instead of passing).
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 120

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
MARKER = re.compile(r"^<!--\s*runnable(?::\s*needs\s+([\w.,\s]+?))?\s*-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)")


def outside_code(text):
    """(line number, line) of every line of a page outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line.lstrip())
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None:
            if line.strip() == fence:
                fence = None
        else:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading: lowercase, punctuation dropped (but - and _),
    spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor the headings of a page give, numbered as GitHub numbers repeats."""
    seen, out = {}, set()
    for _, line in outside_code(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path):
    """(line number, target) of every markdown link outside code."""
    out = []
    for number, line in outside_code(path.read_text()):
        plain = re.sub(r"(`+)(?:(?!\1).)+?\1", lambda c: "x" * len(c.group(0)), line)
        out.extend((number, target) for target in LINK.findall(plain))
    return out


def broken_links():
    broken = []
    for page in PAGES:
        for number, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):    # http:, https:, mailto:
                continue
            where, _, anchor = target.partition("#")
            dest = page if not where else (page.parent / where).resolve()
            name = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{name} (no file {where})")
            elif anchor:
                if dest.is_dir() or dest.suffix != ".md":
                    broken.append(f"{name} (an anchor into a file that is not markdown)")
                elif anchor not in anchors(dest):
                    broken.append(f"{name} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return broken


def runnable_blocks():
    """(id, needed modules, code) of every block marked runnable."""
    blocks = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        for i, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if not m:
                continue
            name = f"{page.relative_to(ROOT)}:{i + 1}"
            assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", (
                f"{name}: the runnable marker must be right before a ```python block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            needs = [n.strip() for n in (m.group(1) or "").split(",") if n.strip()]
            blocks.append((name, needs, "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


BLOCKS = runnable_blocks()


def test_every_relative_link_resolves():
    broken = broken_links()
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_there_are_runnable_blocks_including_the_readmes_store_example():
    assert len(BLOCKS) >= 3
    readme = [code for name, needs, code in BLOCKS if name.startswith("README.md") and not needs]
    assert any('mpikv.create("dist_sync")' in code or 'mpikv.create("local")' in code
               for code in readme)


@pytest.mark.parametrize("name,needs,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_runnable_block_runs(name, needs, code, tmp_path):
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)}, which is not installed")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPIKV_TIMEOUT", "60")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (
        f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")


def test_slug_follows_githubs_rule():
    assert slug("Uneven data: `join`") == "uneven-data-join"
    assert slug("MXNet's own clients: `mpikv.mxnet`") == "mxnets-own-clients-mpikvmxnet"
    assert slug("Training: optimizers on the owners, checkpoints, resume anywhere") == (
        "training-optimizers-on-the-owners-checkpoints-resume-anywhere")
    assert slug("Not supported (yet)") == "not-supported-yet"
