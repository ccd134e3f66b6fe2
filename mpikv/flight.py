"""The flight recorder: every rank's last collective calls, for when a job hangs.

Each process keeps the last ``MPIKV_TRACE_CALLS`` (default 64) collective
calls of its distributed stores in a ring: the operation, the first keys and
their count, the bytes, the priority, and when the call started, when the
ranks agreed on it and when it ended. When the job is ended (a timeout, an
uncaught exception), every rank prints its ring, or writes it to
``MPIKV_TRACE_DIR/rank-N.json`` (see :mod:`mpikv.transport.watchdog`), and
``mpikv trace DIR`` merges the files into one view per call.

Pure: no MPI here.
"""

import json
import os
import time
from pathlib import Path

DEFAULT_CALLS = 64
#: keys shown per call
SHOWN_KEYS = 4
FORMAT = "mpikv.trace/1"

# An entry is a list, written on the hot path without allocation beyond it (the
# keys list is the call's own, which does not change once read):
_STORE, _SEQ, _OP, _KEYS, _NBYTES, _PRIORITY, _START, _AGREED, _END, _ERROR = range(10)
_now = time.time


def _capacity(environ=None):
    raw = (environ or os.environ).get("MPIKV_TRACE_CALLS", DEFAULT_CALLS)
    try:
        return max(0, int(raw))
    except ValueError:
        return DEFAULT_CALLS


class Recorder:
    """A ring of the last ``capacity`` calls (0: records nothing).

    Args:
        capacity: how many calls to keep.
    """

    def __init__(self, capacity=DEFAULT_CALLS):
        self.capacity = capacity
        self._ring = [None] * capacity
        self._next = 0

    def begin(self, store, seq, op, keys, nbytes, priority):
        """Records the start of call ``seq`` of store number ``store``; returns its entry
        (pass it to :func:`agreed`, :func:`ended`, :func:`failed`), or None if off."""
        if not self.capacity:
            return None
        entry = [store, seq, op, keys, nbytes, priority, _now(), None, None, None]
        self._ring[self._next % self.capacity] = entry
        self._next += 1
        return entry

    def withdraw(self, entry):
        """Takes ``entry`` out of the ring (a step that needs no record once it
        ended well: a store's creation)."""
        for i, e in enumerate(self._ring):
            if e is entry:
                self._ring[i] = None

    def entries(self):
        """The recorded calls, oldest first, as dicts."""
        n, cap = self._next, self.capacity
        picked = [self._ring[i % cap] for i in range(max(0, n - cap), n)] if cap else []
        return [as_dict(e) for e in picked if e is not None]


def agreed(entry):
    """Marks the ranks' agreement on the call."""
    if entry is not None:
        entry[_AGREED] = _now()


def ended(entry):
    """Marks the end of the call's data movement."""
    if entry is not None:
        entry[_END] = _now()


def failed(entry, error):
    """Marks a call that raised (``error``: the exception's class name)."""
    if entry is not None:
        entry[_ERROR] = error
        entry[_END] = time.time()


def relabel(entry, op, keys, nbytes):
    """Names the call a joined rank took part in (known only after its agreement)."""
    if entry is not None:
        entry[_OP], entry[_KEYS], entry[_NBYTES] = op, keys, nbytes


def as_dict(entry):
    return {"store": entry[_STORE], "seq": entry[_SEQ], "op": entry[_OP],
            "keys": [k if isinstance(k, (int, str)) else repr(k)
                     for k in entry[_KEYS][:SHOWN_KEYS]],
            "num_keys": len(entry[_KEYS]), "bytes": entry[_NBYTES],
            "priority": entry[_PRIORITY] if isinstance(entry[_PRIORITY], int) else "per key",
            "start": entry[_START], "agreed": entry[_AGREED], "end": entry[_END],
            "error": entry[_ERROR]}


#: every store of this process records here
RECORDER = Recorder(_capacity())


def state(call, now=None):
    """``"done"``, ``"raised X"``, ``"in agreement for 3.2 s"`` or ``"moving data for 3.2 s"``."""
    if call["error"]:
        return f"raised {call['error']}"
    if call["end"] is not None:
        return "done"
    now = time.time() if now is None else now
    if call["agreed"] is None:
        return f"waiting for the other ranks to agree for {now - call['start']:.1f} s"
    return f"moving data for {now - call['agreed']:.1f} s"


def what(call):
    """``"push (keys 'b', 'w'; 2 keys, 48 B)"``."""
    n = call["num_keys"]
    if not n:
        return f"{call['op']} (no keys)"
    keys = ", ".join(repr(k) for k in call["keys"]) + (", ..." if n > len(call["keys"]) else "")
    return f"{call['op']} (keys {keys}; {n} key{'s' if n != 1 else ''}, {_size(call['bytes'])})"


def describe(call):
    """``"store 0 call 12: push (keys 'b', 'w'; 2 keys, 48 B)"``."""
    return f"store {call['store']} call {call['seq']}: {what(call)}"


def last_call(calls, now=None):
    """One line: which call a rank was last in, and its state."""
    if not calls:
        return "no collective call yet"
    last = calls[-1]
    line = f"{describe(last)}, {state(last, now)}"
    if last["end"] is not None:
        now = time.time() if now is None else now
        line += f"; in no mpikv call since, for {now - last['end']:.1f} s"
    return line


def format_ring(rank, calls, now=None):
    """The ring as text, one call per line, each prefixed with the rank."""
    now = time.time() if now is None else now
    n = len(calls)
    lines = [f"[rank {rank}] mpikv flight recorder: last {n} call{'s' if n != 1 else ''}, "
             f"oldest first"]
    for c in calls:
        lines.append(f"[rank {rank}]   {describe(c)} priority {c['priority']}, "
                     f"started {now - c['start']:.3f} s ago, {state(c, now)}")
    return "\n".join(lines)


def write(directory, rank, calls, reason):
    """Writes ``directory/rank-N.json`` (atomically); returns its path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"rank-{rank}.json"
    tmp = path / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "rank": rank, "written": time.time(),
                               "reason": reason, "calls": calls}, indent=1))
    os.replace(tmp, target)
    return target


def read(directory):
    """rank -> that rank's file (dict), for every ``rank-N.json`` in ``directory``."""
    found = {}
    for path in sorted(Path(directory).glob("rank-*.json")):
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not an mpikv trace file")
        found[int(data["rank"])] = data
    return found


def merge(files):
    """The per-call view of several ranks' rings.

    Args:
        files: rank -> file, from :func:`read`.

    Returns:
        str: one block per call (store, number), oldest first: each rank's view
        of it, and a line for ranks that have no such call or a different one.
    """
    ranks = sorted(files)
    by_call = {}
    for rank in ranks:
        for c in files[rank]["calls"]:
            by_call.setdefault((c["store"], c["seq"]), {})[rank] = c
    lines = [f"mpikv trace: {len(ranks)} rank(s): {', '.join(map(str, ranks))}"]
    for rank in ranks:
        f = files[rank]
        lines.append(f"  rank {rank}: {f['reason']}")
        lines.append(f"    last call: {last_call(f['calls'], f['written'])}")
    body, first = [], None
    for (store, seq), seen in sorted(by_call.items()):
        ops = {(c["op"], tuple(c["keys"]), c["num_keys"]) for c in seen.values()}
        rows, missing = [], False
        for rank in ranks:
            c = seen.get(rank)
            if c is None:
                earliest = min((x["seq"] for x in files[rank]["calls"] if x["store"] == store),
                               default=None)
                older = earliest is not None and seq < earliest
                missing = missing or not older
                rows.append(f"  rank {rank}: -- ({'older than its ring' if older else 'not made'})")
                continue
            rows.append(f"  rank {rank}: {what(c)}, {state(c, files[rank]['written'])}")
        differ = len(ops) > 1 or missing
        if differ and first is None:
            first = (store, seq)
        body.append(f"store {store} call {seq}" + ("   <-- ranks differ" if differ else ""))
        body.extend(rows)
    lines.append("first call the ranks differ on: " + (
        "none" if first is None else f"store {first[0]} call {first[1]}"))
    return "\n".join(lines + body)


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def main(argv):
    """``mpikv trace DIR``: prints the merged view of the rings written there."""
    import argparse
    parser = argparse.ArgumentParser(prog="mpikv trace", description=(
        "Merge the flight-recorder files (rank-N.json) that a job ended by mpikv "
        "wrote under MPIKV_TRACE_DIR, into one view per call."))
    parser.add_argument("dir", help="the MPIKV_TRACE_DIR of the job")
    args = parser.parse_args(argv)
    try:
        files = read(args.dir)
    except (OSError, ValueError) as exc:
        print(f"mpikv trace: {exc}")
        return 1
    if not files:
        print(f"mpikv trace: no rank-N.json files in {args.dir}")
        return 1
    print(merge(files))
    return 0
