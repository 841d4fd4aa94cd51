"""`neuron-cache`: warm, move and inspect the executable cache (`python -m neuron_runtime.cli`).

    warm / compile     record a job's signatures, compile them in parallel worker processes   (_warm.py)
    export / import    single-file bundles of verified entries (tar + JSON manifest)           (_bundle.py)
    ls / stats / verify / prune / clear                                                        (_inspect.py)
    explain            why a signature misses: the closest entries and the part of the key that differs
                                                                                               (_explain.py)
"""

from neuron_runtime.cli._main import main

__all__ = ["main"]
