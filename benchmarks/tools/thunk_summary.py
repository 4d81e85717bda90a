"""What an XLA GPU executable runs, from the thunk sequences XLA dumps (`XLA_FLAGS=--xla_dump_to=DIR`):
per file, the thunks at the top level by kind (what the host issues one by one at each call: a
kCommandBuffer is one graph launch) and the thunks nested inside them (recorded into graphs).

    python benchmarks/tools/thunk_summary.py DIR/*thunk_sequence*.txt
"""

from __future__ import annotations

import collections
import os
import re
import sys

_LINE = re.compile(r"^(\s*)\d+: (k\w+)")


def summary(path: str) -> dict:
    """{"top": Counter of top-level kinds, "nested": Counter of nested kinds, "runs": top-level kinds
    in order, consecutive equal kinds merged as (kind, count)}."""
    top, nested, runs = collections.Counter(), collections.Counter(), []
    with open(path) as f:
        for line in f:
            m = _LINE.match(line)
            if not m:
                continue
            kind = m.group(2)
            if m.group(1):
                nested[kind] += 1
                continue
            top[kind] += 1
            if runs and runs[-1][0] == kind:
                runs[-1][1] += 1
            else:
                runs.append([kind, 1])
    return {"top": top, "nested": nested, "runs": runs}


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    for p in paths:
        s = summary(p)
        print(os.path.basename(p))
        print("  top level:", ", ".join(f"{k} {n}" for k, n in s["top"].most_common()) or "-")
        print("  nested:   ", ", ".join(f"{k} {n}" for k, n in s["nested"].most_common()) or "-")
        order = " ".join(f"{k}x{n}" if n > 1 else k for k, n in s["runs"])
        print("  order:    ", order[:600] + (" ..." if len(order) > 600 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
