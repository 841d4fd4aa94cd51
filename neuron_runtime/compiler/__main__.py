"""`python -m neuron_runtime.compiler`: build the `aoti` tier's shared runtime now (make install does),
so no compile of this host pays for it: the precompiled header, AOTInductor's runtime object and the
link stub, for this host's toolchain, torch and TORCH_NEURONX_AOTI_* settings (compiler/_aoti_runtime.py).
Prints where it lives; on a host that cannot compile (no C++ compiler) it says why and exits 0: the
first compile reports the same, and the ops run on the host."""

from __future__ import annotations

import sys
import time

from .. import _config
from ._aoti import AotiCompiler


def main() -> int:
    cfg = _config.get()
    compiler = AotiCompiler(march=cfg.aoti_march, simdlen=cfg.aoti_simdlen, local_cache_dir=cfg.local_cache_dir,
                            runtime_dir=cfg.aoti_runtime_dir)
    t0 = time.perf_counter()
    try:
        where = compiler.host_runtime().ensure()
    except Exception as e:  # noqa: BLE001 - reported, never fatal to an install
        print(f"neuron: the aoti tier's shared runtime cannot be built here ({type(e).__name__}: {e})", file=sys.stderr)
        return 0
    print(f"{where} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
