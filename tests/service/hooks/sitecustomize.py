"""Fault injection for the compile-service tests, in the real processes (on PYTHONPATH via the tests).

NEURON_TEST_COMPILE_DELAY="aten::addmm=3,*=0.2": the reference compiler sleeps that many seconds before
compiling a signature whose op contains the text (`*`: any op; `hang`: an hour). NEURON_TEST_WORKER_PIDS=
FILE: each compile worker appends its pid to FILE when it starts compiling. Nothing happens unless set.
"""

import os
import sys

_SPEC = os.environ.get("NEURON_TEST_COMPILE_DELAY")
_PIDS = os.environ.get("NEURON_TEST_WORKER_PIDS")
_TARGET = "neuron_runtime.compiler._reference"


def _delay(op):
    for part in (_SPEC or "").split(","):
        pat, _, secs = part.partition("=")
        if pat == "*" or pat in op:
            return 3600.0 if secs == "hang" else float(secs)
    return 0.0


def _patch(module):
    import time

    compile_ = module.ReferenceCompiler.compile

    def slow_compile(self, signature):
        if _PIDS:
            with open(_PIDS, "a") as f:
                f.write(f"{os.getpid()} {signature['op']}\n")
        time.sleep(_delay(signature["op"]))
        return compile_(self, signature)

    module.ReferenceCompiler.compile = slow_compile


class _Hook:
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                exec_module = spec.loader.exec_module

                def run(module, exec_module=exec_module):
                    exec_module(module)
                    _patch(module)

                spec.loader.exec_module = run
                return spec
        return None


if _SPEC or _PIDS:
    sys.meta_path.insert(0, _Hook())
