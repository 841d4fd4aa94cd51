"""`python -m neuron_runtime._native`: build the native dispatch layer now (make demo / make test do)."""

from __future__ import annotations

import sys

from ._build import build

if __name__ == "__main__":
    print(build())
    sys.exit(0)
