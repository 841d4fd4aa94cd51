"""How an op runs: one PrivateUse1 kernel per aten op, by the op's kind (`signatures._ops`).

    _kernels.py   registers every op's kernel: its own (`SPECIAL`) or the one of its kind
    _special.py   allocation, cross-device copies, resizes, convolution's overrideable entry
    _decomp.py    ops computed from other ops (out= factories, batch norm's update, ...)
    _generic.py   the kernel of a kind: view (metadata only), host, or generated compute/mutating
    _codegen.py   the generated kernels of compute/mutating ops: the hit path
    _runtime.py   the runtime: executables, counters, the slow path (`Runtime.slow_call`), host runs, fallbacks
    _host.py      the CPU views of neuron tensors (`alias`, `wrap`) and the copies between them
    _fusion.py    the experimental fusion queue (TORCH_NEURONX_ENABLE_CONCATENATION=1)
    _widen.py     dtypes a host kernel lacks, computed in a wider one
    _writes.py    checks on what in-place and out= ops write (device, dtype), in CUDA's words
    _quantized.py quantized tensors: refused with one error wherever one would be made on neuron

A call's signature goes down to `executables/` for its executable. What the layers above use is named
here; nothing here is public API.
"""

from ._fusion import flush as flush_fusion
from ._host import alias, forget, wrap
from ._kernels import register_all as register_kernels
from ._runtime import made_runtime, reset_runtime, runtime
from ._widen import named_dtypes, result_dtypes, run as run_widened

__all__ = ["alias", "flush_fusion", "forget", "made_runtime", "named_dtypes", "register_kernels", "reset_runtime",
           "result_dtypes", "run_widened", "runtime", "wrap"]
