"""Refuse a mixed install: AWS's `torch-neuronx` and this package both provide `torch_neuronx`.

neuron-runtime ships a `torch_neuronx` package (the name Hugging Face's libraries detect a Neuron device
by). AWS's `torch-neuronx` distribution owns the same directory; pip installs one over the other
without a word, which would leave a half-and-half package and two PrivateUse1 backends. So whenever
the runtime loads (`import torch`, `import torch_neuronx`) it looks for AWS's distribution and, if it
is installed, stops with an error that names both and the fix.
"""

from __future__ import annotations

import importlib.metadata

# Distribution names AWS publishes the real package under (pip normalises `_` and `-`).
_AWS_DISTRIBUTIONS = ("torch-neuronx",)


class PackageConflictError(RuntimeError):
    """AWS's torch-neuronx is installed beside neuron-runtime."""


def aws_distribution() -> str | None:
    """`name version` of AWS's torch-neuronx distribution if it is installed, else None."""
    for name in _AWS_DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return f"{dist.metadata['Name']} {dist.version}"
    return None


def check() -> None:
    found = aws_distribution()
    if found is None:
        return
    raise PackageConflictError(
        f"AWS's {found} is installed beside neuron-runtime, and both provide the `torch_neuronx` package "
        "(one has overwritten the other's files). Use one: `pip uninstall torch-neuronx` to run on "
        "neuron-runtime's device, or `pip uninstall neuron-runtime` (then reinstall torch-neuronx) to run on "
        "AWS's. TORCH_DEVICE_BACKEND_AUTOLOAD=0 stops `import torch` from loading neuron-runtime.")
