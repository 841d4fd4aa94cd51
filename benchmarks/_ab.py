"""Side-by-side timing shared by the benchmarks: interleaved A/B rounds, medians."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence


def interleaved_medians(a: Callable[[], float], b: Callable[[], float], rounds: int) -> tuple[float, float]:
    """Median of `a()` and of `b()` (each returns one round's time) over `rounds` rounds, A then B in each:
    a host that speeds up or slows down in between moves both sides alike."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(a())
        tb.append(b())
    return statistics.median(ta), statistics.median(tb)


def child_result(code: str, args: Sequence[str], env: dict[str, str], timeout: float = 4 * 3600) -> int:
    """Run `code` in a fresh interpreter with `args` and `env`; print the JSON after its `RESULT ` line
    (indented) and return 0, or exit saying it failed (its stderr is already on ours)."""
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True,
                       timeout=timeout)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"run failed ({p.returncode}); its stderr is above")
    print(json.dumps(json.loads(line[len("RESULT "):]), indent=1))
    return 0
