"""What PyTorch sees: the `neuron` device itself. The top layer.

    _register.py      rename PrivateUse1, device module, guard and hooks, tensor methods (`register()`)
    _torch_neuron.py  `torch.neuron`: device count and index, memory counters, RNG state, streams
    _streams.py       streams and events (ops run in order on the host)
    _autocast.py      autocast for the neuron key (per-op casts)
    _rnn.py           RNN cells PyTorch only fuses for CUDA
    _shims.py         the unavoidable monkeypatches, each naming its upstream gap
    _conflicts.py     another package's `neuron` backend: fail clearly

Imports `aten/` and `graphs/` below it; nothing below imports it. Nothing here is public API:
`neuron_runtime` and `torch.neuron` are; the package root uses the names below.
"""

from ._autocast import install as install_autocast
from ._conflicts import check as check_conflicts
from ._register import register as register_device
from ._rnn import install as install_rnn
from ._shims import install as install_shims
from ._torch_neuron import DEVICE, set_capacity

__all__ = ["DEVICE", "check_conflicts", "install_autocast", "install_rnn", "install_shims", "register_device",
           "set_capacity"]
