"""Fault injection for the compile-service tests, in the real processes (on PYTHONPATH via the tests).

NEURON_TEST_COMPILE_DELAY="aten::addmm=3,*=0.2": the reference compiler sleeps that many seconds before
compiling a signature whose op contains the text (`*`: any op; `hang`: an hour). NEURON_TEST_WORKER_PIDS=
FILE: each compile worker appends its pid to FILE when it starts compiling.
NEURON_TEST_COMPILE_CRASH="aten::mul": the compiling process dies of SIGSEGV on such a signature.
NEURON_TEST_COMPILE_ERRNO="aten::add=ENOSPC": compiling such a signature fails as a full disk makes a
compiler fail (a refusal caused by `OSError(ENOSPC)`, as the aoti tier wraps what Inductor raises).
NEURON_TEST_LOAD_ERRNO="aten::add=EMFILE": loading such an executable fails with that OSError (a host out
of file descriptors). NEURON_TEST_CPU_BELOW=1: this host's CPU is "below" every aoti target
(`_toolchain.check_host` raises, as on a CPU without AVX2). NEURON_TEST_WORKER_START_FAIL=FILE: a compile
worker exits before it is ready while FILE exists. Nothing happens unless set.
"""

import os
import sys

_SPEC = os.environ.get("NEURON_TEST_COMPILE_DELAY")
_PIDS = os.environ.get("NEURON_TEST_WORKER_PIDS")
_CRASH = os.environ.get("NEURON_TEST_COMPILE_CRASH")
_ERRNO = os.environ.get("NEURON_TEST_COMPILE_ERRNO")
_LOAD = os.environ.get("NEURON_TEST_LOAD_ERRNO")
_BELOW = os.environ.get("NEURON_TEST_CPU_BELOW")
_NOSTART = os.environ.get("NEURON_TEST_WORKER_START_FAIL")


def _delay(op):
    for part in (_SPEC or "").split(","):
        pat, _, secs = part.partition("=")
        if pat and (pat == "*" or pat in op):
            return 3600.0 if secs == "hang" else float(secs)
    return 0.0


def _matching(spec, op):
    for part in (spec or "").split(","):
        pat, _, value = part.partition("=")
        if pat and pat in op:
            return value or True
    return None


def _patch_reference(module):
    import errno
    import json
    import signal
    import time

    compile_, load_ = module.ReferenceCompiler.compile, module.ReferenceCompiler.load

    def compile(self, signature):
        op = signature["op"]
        if _PIDS:
            with open(_PIDS, "a") as f:
                f.write(f"{os.getpid()} {op}\n")
        if _matching(_CRASH, op):
            os.kill(os.getpid(), signal.SIGSEGV)
        code = _matching(_ERRNO, op)
        if code:
            try:
                raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
            except OSError as e:
                raise module.CompileRefused(f"{op}: build failed ({e})") from e
        time.sleep(_delay(op))
        return compile_(self, signature)

    def load(self, payload):
        code = _matching(_LOAD, json.loads(payload)["signature"]["op"])
        if code:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return load_(self, payload)

    module.ReferenceCompiler.compile = compile
    module.ReferenceCompiler.load = load


def _patch_toolchain(module):
    def check_host(march):
        raise module.ToolchainError(f"this CPU lacks avx2 required by TORCH_NEURONX_AOTI_MARCH={march} (test)")

    module.check_host = check_host


_TARGETS = {}
if _SPEC or _PIDS or _CRASH or _ERRNO or _LOAD:
    _TARGETS["neuron_runtime.compiler._reference"] = _patch_reference
if _BELOW:
    _TARGETS["neuron_runtime.compiler._toolchain"] = _patch_toolchain


class _Hook:
    def find_spec(self, name, path=None, target=None):
        patch = _TARGETS.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                exec_module = spec.loader.exec_module

                def run(module, exec_module=exec_module):
                    exec_module(module)
                    patch(module)

                spec.loader.exec_module = run
                return spec
        return None


if _NOSTART and os.path.exists(_NOSTART) and "neuron_runtime.executables._service._worker" in " ".join(sys.orig_argv):
    os._exit(3)
if _TARGETS:
    sys.meta_path.insert(0, _Hook())
