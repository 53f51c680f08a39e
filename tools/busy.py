"""Run a command with busy loops beside it: ``python tools/busy.py N -- CMD ...``.

Starts ``N`` processes that spin on the CPU (``while True: pass``), runs ``CMD``, stops the
loops, and exits with ``CMD``'s status. ``make test-busy`` runs the engine suites this way
(issue #42): every real-time limit in a law must be a safety net far above a correct engine on
a loaded machine, so a law that races the clock fails here instead of once in a while in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

SPIN = "while True:\n    pass\n"


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python tools/busy.py N -- CMD [ARG ...]", file=sys.stderr)
        return 2
    loops = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(int(argv[0]))]
    try:
        print(f"busy.py: {len(loops)} busy loops beside: {' '.join(argv[2:])}", flush=True)
        status = subprocess.call(list(argv[2:]))
        print(f"busy.py: exit {status}, load average {os.getloadavg()}", flush=True)
        return status
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
